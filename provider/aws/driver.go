package aws

import (
	"context"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/pricing"
	"github.com/aws/aws-sdk-go-v2/service/ssm"
	"github.com/aws/smithy-go/middleware"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
	"github.com/runfleet/runfleet/version"
)

func init() { provider.Register("aws", driver{}) }

// driver is the registry's entry for EC2 instances, configured by the
// pool's `aws:` section.
type driver struct{}

func (driver) Check(c provider.PoolConfig) error {
	_, err := DecodeSection(c.Section)
	return err
}

// Open loads the SDK's configuration (the standard credential chain,
// resolved at the first call: Open calls nothing) and makes the pool's
// provider.
func (driver) Open(ctx context.Context, c provider.PoolConfig) (provider.Provider, error) {
	s, err := DecodeSection(c.Section)
	if err != nil {
		return nil, err
	}
	calls := new(atomic.Int64)
	cfg, limits, err := load(ctx, s, nil)
	if err != nil {
		return nil, err
	}
	client, params, region := ec2Client(cfg, s, calls, limits), ssmClient(cfg, s, calls, limits), cfg.Region
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	var keys []*rsa.PublicKey
	if s.HandoffURL != "" {
		if keys, err = LoadIdentityCerts(s.IdentityCerts); err != nil {
			return nil, fmt.Errorf("aws.identity_certs: %w", err)
		}
	}
	idle := vm.InstanceIdle(s.IdleTimeout.Duration, c.IdleTimeout, DefaultIdleTimeout)
	life := c.MaxLifetime
	if life == 0 {
		life = DefaultLifetime
	}
	return New(Options{
		API: client, SSM: params, SSMEndpoint: awssdk.ToString(params.Options().BaseEndpoint), Pricing: pricingClient(cfg, s, calls), Region: region, Manager: c.Manager, Pool: c.Pool, Section: s,
		IdleTimeout: idle, Lifetime: life, Calls: calls, IdentityKeys: keys,
		Logger: log.With("provider", "aws", "pool", c.Pool, "region", region),
	}), nil
}

// Client is an EC2 client for the section: its region (or the
// environment's), profile and endpoint, and the standard credential
// chain, within EC2's request rates (limits; nil: the ones shared by the
// clients of the region and endpoint). calls, when set, counts the
// requests sent.
func Client(ctx context.Context, s Section, calls *atomic.Int64, limits *Limits) (*ec2.Client, string, error) {
	cfg, limits, err := load(ctx, s, limits)
	if err != nil {
		return nil, "", err
	}
	return ec2Client(cfg, s, calls, limits), cfg.Region, nil
}

// load is the SDK's configuration for the section, and the limits its
// clients keep to.
func load(ctx context.Context, s Section, limits *Limits) (awssdk.Config, *Limits, error) {
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
		return awssdk.Config{}, nil, fmt.Errorf("aws: %w", err)
	}
	if cfg.Region == "" {
		return awssdk.Config{}, nil, errors.New("aws.region: not set, and neither AWS_REGION nor the profile gives one")
	}
	if limits == nil {
		limits = sharedLimits.Get(cfg.Region + " " + s.Endpoint)
	}
	return cfg, limits, nil
}

func ec2Client(cfg awssdk.Config, s Section, calls *atomic.Int64, limits *Limits) *ec2.Client {
	return ec2.NewFromConfig(cfg, func(o *ec2.Options) {
		if s.Endpoint != "" {
			o.BaseEndpoint = awssdk.String(s.Endpoint)
		}
		o.APIOptions = append(o.APIOptions, apiOptions(calls, limits)...)
		o.Retryer = retry.NewStandard(func(so *retry.StandardOptions) {
			so.Retryables = append([]retry.IsErrorRetryable{noRetry}, so.Retryables...)
		})
	})
}

// ssmClient is the Parameter Store client of the handoff, within the
// same limits and count.
func ssmClient(cfg awssdk.Config, s Section, calls *atomic.Int64, limits *Limits) *ssm.Client {
	return ssm.NewFromConfig(cfg, func(o *ssm.Options) {
		if s.SSMEndpoint != "" {
			o.BaseEndpoint = awssdk.String(s.SSMEndpoint)
		}
		o.APIOptions = append(o.APIOptions, apiOptions(calls, limits)...)
	})
}

// pricingClient is the Price List Query API's client, at the endpoint
// nearest the pool's region (PricingRegion) or the section's
// pricing_endpoint, counted with the rest; its calls are not EC2's and
// share none of EC2's limits.
func pricingClient(cfg awssdk.Config, s Section, calls *atomic.Int64) *pricing.Client {
	return pricing.NewFromConfig(cfg, func(o *pricing.Options) {
		o.Region = PricingRegion(cfg.Region)
		if s.PricingEndpoint != "" {
			o.BaseEndpoint = awssdk.String(s.PricingEndpoint)
		}
		o.APIOptions = append(o.APIOptions, apiOptions(calls, NewLimits())...)
	})
}

// apiOptions are the middlewares every client has: the limits, the
// User-Agent saying runfleet/<version> among the SDK's own parts, the
// count of requests.
func apiOptions(calls *atomic.Int64, limits *Limits) []func(*middleware.Stack) error {
	opts := []func(*middleware.Stack) error{limitAttempts(limits), awsmiddleware.AddUserAgentKeyValue("runfleet", version.Get().Version)}
	if calls != nil {
		opts = append(opts, countAttempts(calls))
	}
	return opts
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

// cmlTables are CML's aliases on AWS, from the iterative provider's
// tables, except m+v100: the table says p3.xlarge, which AWS has never
// offered; p3.2xlarge is the one-V100 type.
var cmlTables = vm.Tables{
	Cloud:         "AWS",
	DefaultRegion: "us-west",
	Regions:       map[string]string{"us-east": "us-east-1", "us-west": "us-west-1", "eu-north": "eu-north-1", "eu-west": "eu-west-1"},
	Types: map[string]string{
		"s": "t2.micro", "m": "m5.2xlarge", "l": "m5.8xlarge", "xl": "m5.16xlarge",
		"m+t4":  "g4dn.xlarge",
		"m+k80": "p2.xlarge", "l+k80": "p2.8xlarge", "xl+k80": "p2.16xlarge",
		"m+v100": "p3.2xlarge", "l+v100": "p3.8xlarge", "xl+v100": "p3.16xlarge",
	},
}

// The stock images CML's runners boot without --cloud-image, as AWS and
// Canonical publish them in Systems Manager's public parameters, which
// RunInstances resolves at launch (EC2 User Guide, "Reference AMIs using
// Systems Manager parameters"): Ubuntu 24.04 LTS, and for GPU types AWS's
// Deep Learning Base AMI with NVIDIA's driver, Docker and the container
// toolkit (Ubuntu 22.04). Resolving them needs ssm:GetParameters.
const (
	StockUbuntu = "resolve:ssm:/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
	StockGPU    = "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)

// gpuFamily is the instance families with NVIDIA GPUs (g4dn, g5, g6e, p3,
// p4d, p5, ...).
var gpuFamily = lazyregexp.New(`^(g|p)\d[a-z]*\.`)

// StockImage is the stock image for an instance type.
func StockImage(typ string) string {
	if gpuFamily.MatchString(typ) {
		return StockGPU
	}
	return StockUbuntu
}

// CMLSection takes `--cloud=aws` as CML does (vm.ParseCML): the region,
// the type, the disk, spot and its price, the startup script, the image
// (an AMI holding runfleet and the forge's agent), --cloud-permission-set
// (an instance profile), --cloud-metadata (tags), --cloud-ssh-private (its
// public key is authorised on the instance; the private key stays here),
// and AWS's own --cloud-aws-security-group and --cloud-aws-subnet.
// Credentials come from the SDK's standard chain.
func (driver) CMLSection(o provider.CMLOptions) (json.RawMessage, bool, error) {
	c := o.Cloud
	if c["cloud"] != "aws" {
		return nil, false, nil
	}
	cml, err := vm.ParseCML(o, cmlTables)
	errs := []error{err}
	install, err := cml.Stock(o, "aws", StockImage(cml.Type), "an AMI (images/ tells how to build one)")
	errs = append(errs, err)
	s := Section{Image: cml.Image, Install: install, Region: cml.Region, InstanceTypes: []string{cml.Type}, Spot: cml.Spot, SpotMaxPrice: cml.SpotPrice,
		StartupScript: cml.StartupScript, InstanceProfile: cml.PermissionSet, Tags: cml.Metadata, SSHPublicKey: cml.SSHPublicKey}
	s.RootVolume.SizeGB = cml.HDDSizeGB
	if sg := c["cloud-aws-security-group"]; sg != "" {
		s.SecurityGroups = []string{sg}
	}
	if sub := c["cloud-aws-subnet"]; sub != "" {
		s.Subnets = []string{sub}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, true, err
	}
	b, err := json.Marshal(s)
	return b, true, err
}
