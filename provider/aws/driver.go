package aws

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/smithy-go/middleware"
	"golang.org/x/crypto/ssh"

	"github.com/runfleet/runfleet/provider"
)

func init() { provider.Register("aws", driver{}) }

// driver is the registry's entry for EC2 instances, configured by the
// pool's `aws:` section.
type driver struct{}

// IdleGrace is how much longer than the pool's idle_timeout an instance
// waits for a job before it powers itself off. The manager retires an
// idle runner registration first, so that no job can be handed to it as
// it goes; an instance ending by itself cannot, and a job handed to it in
// the moment before its agent says it is busy is lost with it (the chaos
// test saw one). The instance's own timeout is therefore only for when
// the manager is gone, and the manager, while it is up, always acts
// first.
const IdleGrace = time.Minute

// instanceIdle is an instance's own idle timeout: the section's as given,
// or the pool's and IdleGrace, or DefaultIdleTimeout.
func instanceIdle(section, pool time.Duration) time.Duration {
	switch {
	case section > 0:
		return section
	case pool > 0:
		return pool + IdleGrace
	}
	return DefaultIdleTimeout
}

func (driver) Check(c provider.PoolConfig) error {
	_, err := DecodeSection(c.Section)
	return err
}

// Open loads the SDK's configuration (the standard credential chain,
// resolved at the first call: Open calls nothing) and makes the pool's
// provider.
func (driver) Open(c provider.PoolConfig) (provider.Provider, error) {
	s, err := DecodeSection(c.Section)
	if err != nil {
		return nil, err
	}
	calls := new(atomic.Int64)
	client, region, err := Client(context.Background(), s, calls, nil)
	if err != nil {
		return nil, err
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	idle := instanceIdle(s.IdleTimeout.Duration, c.IdleTimeout)
	life := c.MaxLifetime
	if life == 0 {
		life = DefaultLifetime
	}
	return New(Options{
		API: client, Manager: c.Manager, Pool: c.Pool, Section: s,
		IdleTimeout: idle, Lifetime: life, Calls: calls,
		Logger: log.With("provider", "aws", "pool", c.Pool, "region", region),
	}), nil
}

// Client is an EC2 client for the section: its region (or the
// environment's), profile and endpoint, and the standard credential
// chain, within EC2's request rates (limits; nil: the ones shared by the
// clients of the region and endpoint). calls, when set, counts the
// requests sent.
func Client(ctx context.Context, s Section, calls *atomic.Int64, limits *Limits) (*ec2.Client, string, error) {
	opts := []func(*awsconfig.LoadOptions) error{
		awsconfig.WithHTTPClient(awshttp.NewBuildableClient().WithTimeout(CallTimeout)),
	}
	if s.Region != "" {
		opts = append(opts, awsconfig.WithRegion(s.Region))
	}
	if s.Profile != "" {
		opts = append(opts, awsconfig.WithSharedConfigProfile(s.Profile))
	}
	cfg, err := awsconfig.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, "", fmt.Errorf("aws: %w", err)
	}
	if cfg.Region == "" {
		return nil, "", errors.New("aws.region: not set, and neither AWS_REGION nor the profile gives one")
	}
	if limits == nil {
		limits = limitsFor(cfg.Region + " " + s.Endpoint)
	}
	client := ec2.NewFromConfig(cfg, func(o *ec2.Options) {
		if s.Endpoint != "" {
			o.BaseEndpoint = awssdk.String(s.Endpoint)
		}
		o.APIOptions = append(o.APIOptions, limitAttempts(limits))
		if calls != nil {
			o.APIOptions = append(o.APIOptions, countAttempts(calls))
		}
		o.Retryer = retry.NewStandard(func(so *retry.StandardOptions) {
			so.Retryables = append([]retry.IsErrorRetryable{noRetry}, so.Retryables...)
		})
	})
	return client, cfg.Region, nil
}

// noRetry keeps the SDK from retrying what a retry cannot fix, and
// capacity errors (InsufficientInstanceCapacity is a 500), for which the
// next type or subnet is tried at once instead.
var noRetry = retry.IsErrorRetryableFunc(func(err error) awssdk.Ternary {
	if k, _ := kindOf(err); k == errCapacity || k == errFatal {
		return awssdk.FalseTernary
	}
	return awssdk.UnknownTernary
})

// limitAttempts makes each attempt of a metered operation wait for a
// token: it sits after the retry middleware.
func limitAttempts(l *Limits) func(*middleware.Stack) error {
	return func(st *middleware.Stack) error {
		return st.Finalize.Add(middleware.FinalizeMiddlewareFunc("runfleetRateLimit",
			func(ctx context.Context, in middleware.FinalizeInput, next middleware.FinalizeHandler) (middleware.FinalizeOutput, middleware.Metadata, error) {
				if lim := l.limiter(middleware.GetOperationName(ctx)); lim != nil {
					if err := lim.Wait(ctx); err != nil {
						return middleware.FinalizeOutput{}, middleware.Metadata{}, err
					}
				}
				return next.HandleFinalize(ctx, in)
			}), middleware.After)
	}
}

// countAttempts counts the requests the SDK sends: it sits after the
// retry middleware, so each attempt counts.
func countAttempts(n *atomic.Int64) func(*middleware.Stack) error {
	return func(st *middleware.Stack) error {
		return st.Finalize.Add(middleware.FinalizeMiddlewareFunc("runfleetCountAttempts",
			func(ctx context.Context, in middleware.FinalizeInput, next middleware.FinalizeHandler) (middleware.FinalizeOutput, middleware.Metadata, error) {
				n.Add(1)
				return next.HandleFinalize(ctx, in)
			}), middleware.After)
	}
}

// cmlRegions are CML's region aliases, as the iterative provider maps
// them on AWS.
var cmlRegions = map[string]string{"us-east": "us-east-1", "us-west": "us-west-1", "eu-north": "eu-north-1", "eu-west": "eu-west-1"}

// cmlTypes are CML's machine sizes on AWS, from the iterative provider's
// table, except m+v100: the table says p3.xlarge, which AWS has never
// offered; p3.2xlarge is the one-V100 type.
var cmlTypes = map[string]string{
	"s": "t2.micro", "m": "m5.2xlarge", "l": "m5.8xlarge", "xl": "m5.16xlarge",
	"m+t4":  "g4dn.xlarge",
	"m+k80": "p2.xlarge", "l+k80": "p2.8xlarge", "xl+k80": "p2.16xlarge",
	"m+v100": "p3.2xlarge", "l+v100": "p3.8xlarge", "xl+v100": "p3.16xlarge",
}

// CMLSection takes `--cloud=aws` as CML does: --cloud-region (CML's
// aliases or a region), --cloud-type (CML's sizes, with --cloud-gpu or
// +gpu, or an instance type), --cloud-hdd-size, --cloud-spot,
// --cloud-spot-price, --cloud-startup-script (base64), --cloud-image
// (an AMI holding runfleet and the forge's agent), --cloud-permission-set
// (an instance profile), --cloud-metadata (tags),
// --cloud-aws-security-group, --cloud-aws-subnet and --cloud-ssh-private
// (its public key is authorised on the instance; the private key stays
// here). Credentials come from the SDK's standard chain.
func (driver) CMLSection(o provider.CMLOptions) (json.RawMessage, bool, error) {
	c := o.Cloud
	if c["cloud"] != "aws" {
		return nil, false, nil
	}
	var errs []error
	s := Section{Image: c["cloud-image"], Spot: c["cloud-spot"] == "true", SpotMaxPrice: c["cloud-spot-price"]}
	if s.Image == "" {
		errs = append(errs, errors.New("--cloud-image: is required with --cloud=aws: an AMI holding runfleet and the forge's agent (images/ tells how to build one)"))
	}
	s.Region = or(c["cloud-region"], "us-west")
	if r, ok := cmlRegions[s.Region]; ok {
		s.Region = r
	}
	typ := or(c["cloud-type"], "m")
	if g := c["cloud-gpu"]; g != "" && !strings.Contains(typ, "+") {
		typ += "+" + g
	}
	if t, ok := cmlTypes[typ]; ok {
		typ = t
	} else if strings.Contains(typ, "+") {
		errs = append(errs, fmt.Errorf("--cloud-type: %q is not one of CML's sizes on AWS (m, l, xl, m+t4, m+k80, l+k80, xl+k80, m+v100, l+v100, xl+v100) or an instance type", typ))
	}
	s.InstanceTypes = []string{typ}
	if hdd := c["cloud-hdd-size"]; hdd != "" {
		n, err := strconv.Atoi(hdd)
		if err != nil {
			errs = append(errs, fmt.Errorf("--cloud-hdd-size: %q is not a number of GB", hdd))
		}
		s.RootVolume.SizeGB = n
	}
	if script := c["cloud-startup-script"]; script != "" {
		b, err := decodeBase64(script)
		if err != nil {
			errs = append(errs, fmt.Errorf("--cloud-startup-script: is not base64, as CML takes it: %v", err))
		}
		s.StartupScript = string(b)
	}
	s.InstanceProfile = c["cloud-permission-set"]
	if sg := c["cloud-aws-security-group"]; sg != "" {
		s.SecurityGroups = []string{sg}
	}
	if sub := c["cloud-aws-subnet"]; sub != "" {
		s.Subnets = []string{sub}
	}
	if md := c["cloud-metadata"]; md != "" {
		s.Tags = map[string]string{}
		for kv := range strings.SplitSeq(md, ",") {
			k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
			if !ok || k == "" {
				errs = append(errs, fmt.Errorf("--cloud-metadata: %q is not key=value", kv))
				continue
			}
			s.Tags[k] = v
		}
	}
	if key := c["cloud-ssh-private"]; key != "" {
		signer, err := ssh.ParsePrivateKey([]byte(key))
		if err != nil {
			errs = append(errs, errors.New("--cloud-ssh-private: is not a private key in PEM or OpenSSH form"))
		} else {
			s.SSHPublicKey = strings.TrimSpace(string(ssh.MarshalAuthorizedKey(signer.PublicKey())))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, true, err
	}
	b, err := json.Marshal(s)
	return b, true, err
}

func decodeBase64(s string) ([]byte, error) {
	s = strings.TrimSpace(s)
	if b, err := base64.StdEncoding.DecodeString(s); err == nil {
		return b, nil
	}
	return base64.RawStdEncoding.DecodeString(s)
}
