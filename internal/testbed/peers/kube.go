package peers

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Kube is a running control plane: etcd, kube-apiserver and
// kube-scheduler, with an admin kubeconfig. Nodes come from kwok
// (StartKwok), a real kubelet (StartKubelet) or a test's own node agent.
type Kube struct {
	URL        string
	Kubeconfig string // the admin's (system:masters)
	Dir        string
	Config     *rest.Config
	Client     kubernetes.Interface
	// CA signs the apiserver's certificate and the clients'.
	ca    *x509.Certificate
	caKey *ecdsa.PrivateKey
	procs []*exec.Cmd
	// exited is closed when the process of the same index ends.
	exited []chan struct{}
	logs   []*os.File
}

// KubeOptions configures StartKube.
type KubeOptions struct {
	Dir      string    // a temporary directory when empty
	Progress io.Writer // build progress on first use
	// NoScheduler leaves pods unscheduled unless a test binds them.
	NoScheduler bool
}

// StartKube builds what it needs on first use and starts a control plane
// on loopback ports.
func StartKube(ctx context.Context, opt KubeOptions) (_ *Kube, err error) {
	if opt.Progress == nil {
		opt.Progress = io.Discard
	}
	etcd, err := EtcdBinary(ctx, opt.Progress)
	if err != nil {
		return nil, err
	}
	apiserver, err := KubeAPIServer(ctx, opt.Progress)
	if err != nil {
		return nil, err
	}
	scheduler, err := KubeScheduler(ctx, opt.Progress)
	if err != nil {
		return nil, err
	}
	if opt.Dir == "" {
		if opt.Dir, err = os.MkdirTemp("", "runfleet-kube-"); err != nil {
			return nil, err
		}
	}
	k := &Kube{Dir: opt.Dir}
	defer func() {
		if err != nil {
			k.Stop()
		}
	}()
	if err := k.writeCerts(); err != nil {
		return nil, err
	}
	ports, err := FreePorts(3)
	if err != nil {
		return nil, err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	if err := k.start("etcd", etcd, "--data-dir", filepath.Join(k.Dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		"--unsafe-no-fsync", "--log-level", "warn"); err != nil {
		return nil, err
	}
	k.URL = fmt.Sprintf("https://127.0.0.1:%d", ports[2])
	f := func(name string) string { return filepath.Join(k.Dir, name) }
	if err := k.start("kube-apiserver", apiserver,
		"--etcd-servers", etcdURL, "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(ports[2]),
		"--advertise-address", "127.0.0.1", "--endpoint-reconciler-type", "none",
		"--tls-cert-file", f("apiserver.crt"), "--tls-private-key-file", f("apiserver.key"),
		"--client-ca-file", f("ca.crt"),
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", f("sa.key"), "--service-account-signing-key-file", f("sa.key"),
		"--service-cluster-ip-range", "10.96.0.0/24",
		"--authorization-mode", "Node,RBAC", "--allow-privileged",
		"--kubelet-client-certificate", f("admin.crt"), "--kubelet-client-key", f("admin.key"),
		"--kubelet-preferred-address-types", "InternalIP",
		"--profiling=false"); err != nil {
		return nil, err
	}
	if err := k.writeKubeconfig(); err != nil {
		return nil, err
	}
	if err := k.waitReady(ctx); err != nil {
		return nil, err
	}
	if !opt.NoScheduler {
		if err := k.start("kube-scheduler", scheduler, "--kubeconfig", k.Kubeconfig,
			"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", "0"); err != nil {
			return nil, err
		}
	}
	return k, nil
}

// start runs one of the control plane's programs, its output in
// <name>.log.
func (k *Kube) start(name, bin string, args ...string) error {
	log, err := os.Create(filepath.Join(k.Dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	k.procs = append(k.procs, cmd)
	k.exited = append(k.exited, done)
	k.logs = append(k.logs, log)
	return nil
}

// waitReady waits for /readyz and then for the default namespace.
func (k *Kube) waitReady(ctx context.Context) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := k.ready(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kube-apiserver not ready in 2m: %w\n%s", err, k.logTail("kube-apiserver"))
		}
		for i, done := range k.exited {
			select {
			case <-done:
				name := filepath.Base(k.procs[i].Path)
				return fmt.Errorf("%s exited: %s\n%s", name, k.procs[i].ProcessState, k.logTail(name))
			default:
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (k *Kube) ready(ctx context.Context) error {
	body, err := k.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("%w: %s", err, body)
	}
	_, err = k.Client.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
	return err
}

// logTail is the end of a program's log.
func (k *Kube) logTail(name string) string {
	b, _ := os.ReadFile(filepath.Join(k.Dir, name+".log"))
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
}

// Stop stops the control plane and removes its data.
func (k *Kube) Stop() {
	for i := len(k.procs) - 1; i >= 0; i-- {
		p := k.procs[i]
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGTERM)
		done := k.exited[i]
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	for _, l := range k.logs {
		l.Close()
	}
	if k.Dir != "" {
		os.RemoveAll(k.Dir)
	}
}

// Namespace creates a namespace with its default service account (no
// controller-manager runs here to make one).
func (k *Kube) Namespace(ctx context.Context, name string) error {
	_, err := k.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	_, err = k.Client.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

func (k *Kube) writeKubeconfig() error {
	cert, _ := os.ReadFile(filepath.Join(k.Dir, "admin.crt"))
	key, _ := os.ReadFile(filepath.Join(k.Dir, "admin.key"))
	k.Kubeconfig = filepath.Join(k.Dir, "admin.kubeconfig")
	if err := k.kubeconfig(k.Kubeconfig, "admin", &clientcmdapi.AuthInfo{ClientCertificateData: cert, ClientKeyData: key}, ""); err != nil {
		return err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", k.Kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 200, 400
	k.Config = cfg
	k.Client, err = kubernetes.NewForConfig(cfg)
	return err
}

// kubeconfig writes a kubeconfig for the cluster, as user with auth, in
// namespace ns ("" for the default).
func (k *Kube) kubeconfig(path, user string, auth *clientcmdapi.AuthInfo, ns string) error {
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: k.ca.Raw})
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["local"] = &clientcmdapi.Cluster{Server: k.URL, CertificateAuthorityData: ca}
	cfg.AuthInfos[user] = auth
	cfg.Contexts["local"] = &clientcmdapi.Context{Cluster: "local", AuthInfo: user, Namespace: ns}
	cfg.CurrentContext = "local"
	return clientcmd.WriteToFile(*cfg, path)
}

// writeCerts makes the CA, the apiserver's serving certificate, the
// admin's client certificate and the service-account signing key.
func (k *Kube) writeCerts() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "runfleet-test-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(7 * 24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return err
	}
	if k.ca, err = x509.ParseCertificate(der); err != nil {
		return err
	}
	k.caKey = key
	files := map[string][]byte{"ca.crt": pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
	serving := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.96.0.1")},
	}
	if files["apiserver.crt"], files["apiserver.key"], err = k.issue("kube-apiserver", nil, serving); err != nil {
		return err
	}
	if files["admin.crt"], files["admin.key"], err = k.issue("admin", []string{"system:masters"}, nil); err != nil {
		return err
	}
	sa, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	saDER, err := x509.MarshalECPrivateKey(sa)
	if err != nil {
		return err
	}
	files["sa.key"] = pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: saDER})
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(k.Dir, name), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// issue signs a certificate: a client's (CN user, O groups) when tmpl is
// nil, else tmpl as a server's.
func (k *Kube) issue(cn string, groups []string, tmpl *x509.Certificate) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	usage := x509.ExtKeyUsageServerAuth
	if tmpl == nil {
		tmpl = &x509.Certificate{Subject: pkix.Name{CommonName: cn, Organization: groups}}
		usage = x509.ExtKeyUsageClientAuth
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl.SerialNumber = serial
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(7*24*time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{usage}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, k.ca, &key.PublicKey, k.caKey)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}

// ServingCert issues a TLS certificate for 127.0.0.1 signed by the
// cluster's CA: a node agent's kubelet endpoint.
func (k *Kube) ServingCert(cn string) (tls.Certificate, error) {
	certPEM, keyPEM, err := k.issue(cn, nil, &x509.Certificate{
		Subject: pkix.Name{CommonName: cn}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
	})
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.X509KeyPair(certPEM, keyPEM)
}

// Apply creates the objects of a YAML file of one or more documents, as
// `kubectl create -f` would; objects that exist are left as they are.
func (k *Kube) Apply(ctx context.Context, manifest []byte) error {
	dc, err := discovery.NewDiscoveryClientForConfig(k.Config)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(k.Config)
	if err != nil {
		return err
	}
	dec := yamlutil.NewYAMLOrJSONDecoder(bytes.NewReader(manifest), 4096)
	for {
		var obj unstructured.Unstructured
		if err := dec.Decode(&obj.Object); err == io.EOF {
			return nil
		} else if err != nil {
			return fmt.Errorf("manifest: %w", err)
		}
		if len(obj.Object) == 0 {
			continue
		}
		gvk := obj.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return fmt.Errorf("%s %s: %w", gvk.Kind, obj.GetName(), err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = dyn.Resource(m.Resource).Namespace(obj.GetNamespace())
		}
		if _, err := ri.Create(ctx, &obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create %s %s: %w", gvk.Kind, obj.GetName(), err)
		}
	}
}

// TokenKubeconfig writes a kubeconfig that acts as a service account,
// with a token from the TokenRequest API, its context in namespace
// contextNS, and returns its path.
func (k *Kube) TokenKubeconfig(ctx context.Context, ns, sa, contextNS string) (string, error) {
	exp := int64(24 * 3600)
	tr, err := k.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authv1.TokenRequest{
		Spec: authv1.TokenRequestSpec{ExpirationSeconds: &exp},
	}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token for %s/%s: %w", ns, sa, err)
	}
	path := filepath.Join(k.Dir, "kubeconfig-"+ns+"-"+sa+"-"+contextNS)
	return path, k.kubeconfig(path, sa, &clientcmdapi.AuthInfo{Token: tr.Status.Token}, contextNS)
}
