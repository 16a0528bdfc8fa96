package kubernetes

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/rest"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/kubeclient"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

func init() { provider.Register("kubernetes", driver{}) }

// driver is the registry's entry for pods, configured by the pool's
// `kubernetes:` section.
type driver struct{}

func (driver) Check(c provider.PoolConfig) error {
	_, err := DecodeSection(c.Section, c.GPUsPerRunner)
	return err
}

// Open connects to the cluster (no call is made until the informer
// starts) and starts watching the pool's pods.
func (driver) Open(ctx context.Context, c provider.PoolConfig) (provider.Provider, error) {
	s, err := DecodeSection(c.Section, c.GPUsPerRunner)
	if err != nil {
		return nil, err
	}
	calls := new(atomic.Int64)
	cfg, ns, err := connect(s, calls)
	if err != nil {
		return nil, err
	}
	cs, err := kubeclient.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	return New(Options{
		Client: cs, Namespace: ns, Manager: c.Manager, Pool: c.Pool, Section: s,
		GPUs: max(c.GPUsPerRunner, 0), MaxLifetime: c.MaxLifetime, Calls: calls,
		Logger: log.With("provider", "kubernetes", "pool", c.Pool, "namespace", ns),
	})
}

// Client rates: the pool starts its runners in parallel, two calls each
// (the pod, its Secret), and client-go's default of 5 a second would make
// a burst of 500 take minutes. The apiserver's own priority and fairness
// protects it.
const (
	DefaultQPS   = 100
	DefaultBurst = 200
)

// connect makes the client configuration from the section (see
// kubeclient) and returns the namespace to use too. calls, when set,
// counts the requests sent.
func connect(s Section, calls *atomic.Int64) (*rest.Config, string, error) {
	return kubeclient.Config(kubeclient.Options{
		Kubeconfig: s.Kubeconfig, Data: s.kubeconfig, Context: s.Context, InCluster: s.InCluster,
		Namespace: s.Namespace, Field: "kubernetes", QPS: DefaultQPS, Burst: DefaultBurst, Calls: calls,
	})
}

// CMLSection takes `--cloud=kubernetes` as CML does: the kubeconfig's
// contents from KUBERNETES_CONFIGURATION (or the default loading rules
// without it), `--cloud-kubernetes-node-selector key=value,...`,
// `--cloud-type` (m, l, xl, with +k80 or +v100, or <cpus>-<memory MB>
// with +<gpu model>*<count>),
// `--cloud-gpu`, `--cloud-hdd-size` (the work directory's limit), and
// `--cloud-image` (the runner image; without it the forge's own runner
// image, or CML's stock image with the agent fetched as the pod starts).
// CML's other cloud options
// (region, spot, AWS settings) mean nothing for pods and are ignored, as
// CML does.
func (driver) CMLSection(o provider.CMLOptions) (json.RawMessage, bool, error) {
	if o.Cloud["cloud"] != "kubernetes" {
		return nil, false, nil
	}
	s := Section{Image: cmp.Or(o.Cloud["cloud-image"], o.AgentImage)}
	if o.Getenv != nil {
		if v, ok := o.Getenv("KUBERNETES_CONFIGURATION"); ok && v != "" {
			// A reference: the section is not the place for
			// credentials, and it is expanded where it is read.
			s.KubeconfigData = "${KUBERNETES_CONFIGURATION}"
		}
	}
	model, err := cmlType(&s, o.Cloud["cloud-type"], o.Cloud["cloud-gpu"])
	if err != nil {
		return nil, true, err
	}
	// The iterative provider's node selector: accelerator=infer unless
	// given, and "infer" is the GPU's model, the key left out without one.
	sel := o.NodeSelector
	if len(sel) == 0 {
		sel = map[string]string{"accelerator": "infer"}
	}
	for k, v := range sel {
		if v == "infer" {
			v = model
		}
		if v != "" || sel[k] != "infer" {
			if s.NodeSelector == nil {
				s.NodeSelector = map[string]string{}
			}
			s.NodeSelector[k] = v
		}
	}
	if s.Image == "" {
		if o.Stock == nil || o.Stock.AgentURL == "" {
			return nil, true, errors.New("--cloud-image: is required with --cloud=kubernetes for this forge: the runner pods' image, holding the forge's agent (images/ has Dockerfiles), since runfleet fetches no release of its agent")
		}
		// As CML's own provider does (terraform-provider-iterative
		// iterative/kubernetes/provider.go), CML's image, with the GPU
		// variant where the pod asks for GPUs.
		s.Image = StockImage
		if _, gpu := s.Resources.Limits[DefaultGPUResource]; gpu {
			s.Image = StockGPUImage
		}
		s.Install.Agent = vm.Download{URL: o.Stock.AgentURL, SHA256: o.Stock.AgentSHA256}
	}
	if hdd := o.Cloud["cloud-hdd-size"]; hdd != "" {
		// The runner's disk is its work directory.
		if _, err := strconv.Atoi(hdd); err != nil {
			return nil, true, fmt.Errorf("--cloud-hdd-size: %q is not a number of GB", hdd)
		}
		s.WorkdirSizeLimit = hdd + "G"
	}
	b, err := json.Marshal(s)
	return b, true, err
}

// The stock images of `runfleet runner --cloud=kubernetes` for a forge
// that publishes no runner image: CML's own (Ubuntu with git, Node.js,
// Python, curl; CUDA in the GPU variant), which CML's Kubernetes runners
// run, and the pod fetches the agent into it as it starts.
const (
	StockImage    = "iterativeai/cml:0-dvc2-base1"
	StockGPUImage = "iterativeai/cml:0-dvc2-base1-gpu"
)

// cmlTypes are CML's machine sizes on Kubernetes, as the iterative
// provider defines them: CPUs, memory, and GPUs with their model.
var cmlTypes = map[string]struct {
	cpu, memory string
	gpus        int64
	model       string
}{
	"s":       {"1", "1Gi", 0, ""},
	"m":       {"8", "32Gi", 0, ""},
	"l":       {"32", "128Gi", 0, ""},
	"xl":      {"64", "256Gi", 0, ""},
	"m+k80":   {"4", "64Gi", 1, "nvidia-tesla-k80"},
	"l+k80":   {"32", "512Gi", 8, "nvidia-tesla-k80"},
	"xl+k80":  {"64", "768Gi", 16, "nvidia-tesla-k80"},
	"m+v100":  {"8", "64Gi", 1, "nvidia-tesla-v100"},
	"l+v100":  {"32", "256Gi", 4, "nvidia-tesla-v100"},
	"xl+v100": {"64", "512Gi", 8, "nvidia-tesla-v100"},
}

// customType is the iterative provider's own size: "8-32000+nvidia-tesla-t4*1".
var customType = lazyregexp.New(`^(\d+)-(\d+)(?:\+([^*]+)\*([1-9]\d*))?$`)

// cmlType sets the requests (as limits too) of a CML machine type, and
// returns its GPU model ("" without GPUs), which an "infer" node selector
// takes.
func cmlType(s *Section, typ, gpu string) (string, error) {
	if typ == "" && gpu == "" {
		return "", nil
	}
	if typ == "" {
		typ = "m" // CML's default size
	}
	t, ok := cmlTypes[typ]
	if key := typ + "+" + gpu; gpu != "" && cmlTypes[key].cpu != "" {
		t, ok = cmlTypes[key], true
	} else if ok && gpu != "" {
		t.model, t.gpus = gpu, max(t.gpus, 1)
	}
	if m := customType.FindStringSubmatch(typ); !ok && m != nil {
		// CPUs-memory in MB, and GPUs as +<model>*<count>.
		t.cpu, t.memory, t.model, ok = m[1], m[2]+"M", m[3], true
		if m[4] != "" {
			t.gpus, _ = strconv.ParseInt(m[4], 10, 64)
		}
	}
	if !ok {
		return "", fmt.Errorf("--cloud-type: %q is not a Kubernetes machine type (s, m, l, xl, with +k80 or +v100, or <cpus>-<memory MB>[+<gpu model>*<count>])", typ)
	}
	list := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse(t.cpu),
		corev1.ResourceMemory: resource.MustParse(t.memory),
	}
	if t.gpus > 0 {
		list[DefaultGPUResource] = *resource.NewQuantity(t.gpus, resource.DecimalSI)
	} else {
		t.model = ""
	}
	s.Resources = corev1.ResourceRequirements{Requests: list, Limits: list.DeepCopy()}
	return t.model, nil
}
