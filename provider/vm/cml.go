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
)

// Tables are one cloud's aliases for CML's --cloud-region and
// --cloud-type, from the iterative terraform provider's documented
// tables.
type Tables struct {
	Cloud         string            // as CML names it: aws, gcp, azure
	Regions       map[string]string // us-east, us-west, eu-north, eu-west
	Types         map[string]string // s, m, l, xl, m+t4, m+k80, ..., xl+v100
	DefaultRegion string            // CML's default region alias
}

// CML is what CML's --cloud-* options say that every cloud takes alike.
type CML struct {
	Region, Type  string // resolved from the tables, or as given
	Image         string
	Spot          bool
	SpotPrice     string
	HDDSizeGB     int
	StartupScript string
	PermissionSet string
	Metadata      map[string]string
	SSHPublicKey  string // of --cloud-ssh-private; the private key stays here
}

// ParseCML reads CML's --cloud-* options (cloud is the option name
// without its dashes, as provider.CMLOptions.Cloud holds them) with a
// cloud's tables: --cloud-region (an alias or the cloud's own), --cloud-type
// (CML's size, with --cloud-gpu or +gpu, or the cloud's own type),
// --cloud-hdd-size (GB), --cloud-spot, --cloud-spot-price,
// --cloud-startup-script (base64), --cloud-image, --cloud-permission-set,
// --cloud-metadata (key=value,...), --cloud-ssh-private. Every problem is
// returned, each naming its option.
func ParseCML(c map[string]string, t Tables) (CML, error) {
	var errs []error
	out := CML{Image: c["cloud-image"], Spot: c["cloud-spot"] == "true", SpotPrice: c["cloud-spot-price"], PermissionSet: c["cloud-permission-set"]}
	out.Region = or(c["cloud-region"], t.DefaultRegion)
	if r, ok := t.Regions[out.Region]; ok {
		out.Region = r
	}
	out.Type = or(c["cloud-type"], "m")
	if g := c["cloud-gpu"]; g != "" && !strings.Contains(out.Type, "+") {
		out.Type += "+" + g
	}
	if typ, ok := t.Types[out.Type]; ok {
		out.Type = typ
	} else if strings.Contains(out.Type, "+") {
		errs = append(errs, fmt.Errorf("--cloud-type: %q is not one of CML's sizes on %s (%s) or a machine type", out.Type, t.Cloud, strings.Join(slices.Sorted(maps.Keys(t.Types)), ", ")))
	}
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
	if md := c["cloud-metadata"]; md != "" {
		out.Metadata = map[string]string{}
		for kv := range strings.SplitSeq(md, ",") {
			k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
			if !ok || k == "" {
				errs = append(errs, fmt.Errorf("--cloud-metadata: %q is not key=value", kv))
				continue
			}
			out.Metadata[k] = v
		}
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
