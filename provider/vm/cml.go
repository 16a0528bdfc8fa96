package vm

import (
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/crypto/ssh"

	"github.com/runfleet/runfleet/provider"
)

// Tables are one cloud's aliases for CML's --cloud-region and
// --cloud-type, from the iterative terraform provider's documented
// tables.
type Tables struct {
	Cloud         string            // as CML names it: aws, gcp, azure
	Regions       map[string]string // us-east, us-west, eu-north, eu-west
	Types         map[string]string // s, m, l, xl, m+t4, m+k80, ..., xl+v100
	DefaultRegion string            // CML's default region alias
	// WithGPU gives a machine type the GPU --cloud-gpu names, where the
	// cloud attaches GPUs to any type (GCP's machine+accelerator*count);
	// nil where the GPU comes with the type, and a GPU beside a type of
	// the cloud's own is ignored, as the iterative provider does.
	WithGPU func(typ, gpu string) string
}

// resolve finds the instance type as the iterative provider does
// (getInstanceType of each cloud): CML's size with the GPU, the size
// alone without one, else the cloud's own type as given.
func (t Tables) resolve(typ, gpu string) (string, error) {
	sizes := func() string { return strings.Join(slices.Sorted(maps.Keys(t.Types)), ", ") }
	if v, ok := t.Types[typ+"+"+gpu]; ok && gpu != "" {
		return v, nil
	}
	size, _, plus := strings.Cut(typ, "+")
	if v, ok := t.Types[typ]; ok {
		switch {
		case gpu == "":
			return v, nil
		case t.WithGPU != nil && !strings.Contains(v, "+"):
			return t.WithGPU(v, gpu), nil
		}
		return "", fmt.Errorf("--cloud-gpu: %q is not one of CML's GPUs for --cloud-type %s on %s (%s)", gpu, typ, t.Cloud, sizes())
	}
	if _, cml := t.Types[size]; plus && (cml || t.WithGPU == nil) {
		return "", fmt.Errorf("--cloud-type: %q is not one of CML's sizes on %s (%s) or a machine type", typ, t.Cloud, sizes())
	}
	if gpu != "" && t.WithGPU != nil && !plus {
		return t.WithGPU(typ, gpu), nil
	}
	return typ, nil
}

// CML is what CML's --cloud-* options say that every cloud takes alike.
type CML struct {
	Region, Type  string // resolved from the tables, or as given
	Image         string
	Spot          bool
	SpotPrice     string // "": none, up to the on-demand price
	HDDSizeGB     int
	StartupScript string
	PermissionSet string
	Metadata      map[string]string
	SSHPublicKey  string // of --cloud-ssh-private; the private key stays here
}

// ParseCML reads CML's --cloud-* options with a cloud's tables:
// --cloud-region (an alias or the cloud's own), --cloud-type (CML's size,
// with --cloud-gpu or +gpu, or the cloud's own type), --cloud-hdd-size
// (GB), --cloud-spot, --cloud-spot-price (a negative price, CML's default
// -1, is none: up to the on-demand price), --cloud-startup-script
// (base64), --cloud-image, --cloud-permission-set, --cloud-metadata,
// --cloud-ssh-private. Every problem is returned, each naming its option.
func ParseCML(o provider.CMLOptions, t Tables) (CML, error) {
	var errs []error
	c := o.Cloud
	out := CML{Image: c["cloud-image"], Spot: c["cloud-spot"] == "true", PermissionSet: c["cloud-permission-set"], Metadata: o.Metadata}
	if p := c["cloud-spot-price"]; p != "" {
		if f, err := strconv.ParseFloat(p, 64); err != nil {
			errs = append(errs, fmt.Errorf("--cloud-spot-price: %q is not a price in USD", p))
		} else if f >= 0 {
			out.SpotPrice = p
		}
	}
	out.Region = or(c["cloud-region"], t.DefaultRegion)
	if r, ok := t.Regions[out.Region]; ok {
		out.Region = r
	}
	typ, err := t.resolve(or(c["cloud-type"], "m"), c["cloud-gpu"])
	if err != nil {
		errs = append(errs, err)
	}
	out.Type = typ
	if hdd := c["cloud-hdd-size"]; hdd != "" {
		n, err := strconv.Atoi(hdd)
		if err != nil || n <= 0 {
			errs = append(errs, fmt.Errorf("--cloud-hdd-size: %q is not a number of GB", hdd))
		}
		out.HDDSizeGB = n
	}
	if script := c["cloud-startup-script"]; script != "" {
		b, err := decodeBase64(script)
		if err != nil {
			errs = append(errs, fmt.Errorf("--cloud-startup-script: is not base64, as CML takes it: %v", err))
		}
		out.StartupScript = string(b)
	}
	if key := c["cloud-ssh-private"]; key != "" {
		signer, err := ssh.ParsePrivateKey([]byte(key))
		if err != nil {
			errs = append(errs, errors.New("--cloud-ssh-private: is not a private key in PEM or OpenSSH form"))
		} else {
			out.SSHPublicKey = strings.TrimSpace(string(ssh.MarshalAuthorizedKey(signer.PublicKey())))
		}
	}
	return out, errors.Join(errs...)
}

// Stock settles the image of a runner CML's options give no --cloud-image:
// the cloud's stock image, and the install section that fetches what it
// lacks, where `runfleet runner` found what to install (o.Stock);
// otherwise --cloud-image is required, an image of the kind want says.
func (c *CML) Stock(o provider.CMLOptions, cloud, stock, want string) (Install, error) {
	switch {
	case c.Image != "":
		return Install{}, nil
	case o.Stock == nil:
		return Install{}, fmt.Errorf("--cloud-image: is required with --cloud=%s here: %s holding runfleet and the forge's agent, since runfleet cannot install them on a stock one", cloud, want)
	}
	c.Image = stock
	s := o.Stock
	return Install{Runfleet: Download{URL: s.RunfleetURL, SHA256: s.RunfleetSHA256}, Agent: Download{URL: s.AgentURL, SHA256: s.AgentSHA256}, Docker: s.Docker}, nil
}

func or(s, alt string) string {
	if s == "" {
		return alt
	}
	return s
}

func decodeBase64(s string) ([]byte, error) {
	s = strings.TrimSpace(s)
	if b, err := base64.StdEncoding.DecodeString(s); err == nil {
		return b, nil
	}
	return base64.RawStdEncoding.DecodeString(s)
}
