package main

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"flag"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/client-go/util/cert"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

// runAPIServer starts an embedded etcd and kube-apiserver on loopback ports, writes
// <dir>/admin.kubeconfig, prints one "ready" JSON line once /readyz answers 200 and runs until
// SIGTERM (kube-apiserver's own signal handler starts the graceful stop).
func runAPIServer(args []string) error {
	fs := flag.NewFlagSet("apiserver", flag.ExitOnError)
	dir := fs.String("dir", "", "directory for etcd data, certificates, keys and the kubeconfig")
	gates := fs.String("feature-gates", "", "kube-apiserver --feature-gates")
	authz := fs.String("authorization-mode", "Node,RBAC", "kube-apiserver --authorization-mode")
	fs.Parse(args)
	if *dir == "" {
		return fmt.Errorf("--dir is required")
	}
	// Anything after the harness's own flags goes to kube-apiserver unchanged.
	extra := fs.Args()

	etcd, etcdURL, err := startEtcd(filepath.Join(*dir, "etcd"))
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer etcd.Close()

	port, err := freePort()
	if err != nil {
		return err
	}
	files, token, err := writeCredentials(*dir, port)
	if err != nil {
		return err
	}
	apiArgs := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", port),
		"--tls-cert-file=" + files.cert,
		"--tls-private-key-file=" + files.key,
		"--token-auth-file=" + files.tokens,
		"--authorization-mode=" + *authz,
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + files.saKey,
		"--service-account-signing-key-file=" + files.saKey,
		// The range is bookkeeping only: no component here routes to it.
		"--service-cluster-ip-range=10.96.0.0/24",
		// Nothing runs the controller-manager, so no "default" ServiceAccount appears:
		// ServiceAccount admission would refuse every Pod the tests create.
		"--disable-admission-plugins=ServiceAccount",
		// Lighter on a shared 2-core machine; fairness queuing buys a test nothing.
		"--enable-priority-and-fairness=false",
		"--profiling=false",
		"--watch-cache=false",
		"--endpoint-reconciler-type=none",
	}
	if *gates != "" {
		apiArgs = append(apiArgs, "--feature-gates="+*gates)
	}
	apiArgs = append(apiArgs, extra...)

	serverURL := fmt.Sprintf("https://127.0.0.1:%d", port)
	go announceReady(serverURL, files, token)

	cmd := app.NewAPIServerCommand()
	cmd.SetArgs(apiArgs)
	return cmd.Execute()
}

type credentialFiles struct {
	cert, key, tokens, saKey, kubeconfig string
}

// writeCredentials makes a fresh serving certificate, a service-account signing key and an
// admin token for this run, so nothing secret is committed and every run is independent.
func writeCredentials(dir string, port int) (credentialFiles, string, error) {
	f := credentialFiles{
		cert:       filepath.Join(dir, "serving.crt"),
		key:        filepath.Join(dir, "serving.key"),
		tokens:     filepath.Join(dir, "tokens.csv"),
		saKey:      filepath.Join(dir, "sa.key"),
		kubeconfig: filepath.Join(dir, "admin.kubeconfig"),
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return f, "", err
	}
	certPEM, keyPEM, err := cert.GenerateSelfSignedCertKey("127.0.0.1", nil, []string{"localhost"})
	if err != nil {
		return f, "", err
	}
	sa, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return f, "", err
	}
	saPEM := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(sa)})
	raw := make([]byte, 16)
	if _, err := rand.Read(raw); err != nil {
		return f, "", err
	}
	token := hex.EncodeToString(raw)
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: harness
  cluster:
    server: https://127.0.0.1:%d
    certificate-authority: %s
users:
- name: admin
  user:
    token: %s
contexts:
- name: admin
  context: {cluster: harness, user: admin}
current-context: admin
`, port, f.cert, token)
	for path, data := range map[string][]byte{
		f.cert: certPEM, f.key: keyPEM, f.saKey: saPEM,
		f.tokens:     []byte(token + `,admin,admin-uid,"system:masters"` + "\n"),
		f.kubeconfig: []byte(kubeconfig),
	} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return f, "", err
		}
	}
	return f, token, nil
}

func startEtcd(dir string) (*embed.Etcd, string, error) {
	clientPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	client, _ := url.Parse(fmt.Sprintf("http://127.0.0.1:%d", clientPort))
	peer, _ := url.Parse(fmt.Sprintf("http://127.0.0.1:%d", peerPort))
	cfg := embed.NewConfig()
	cfg.Dir = dir
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "error"
	// A test cluster's data dies with the test: fsync only costs time on a shared disk.
	cfg.UnsafeNoFsync = true
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", err
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, "", fmt.Errorf("not ready after 60s")
	}
	return e, client.String(), nil
}

// announceReady polls /readyz with the admin token and prints the ready line once; a server
// that never gets ready is the caller's timeout to report, with the log it collected.
func announceReady(serverURL string, files credentialFiles, token string) {
	pool := x509.NewCertPool()
	if data, err := os.ReadFile(files.cert); err == nil {
		pool.AppendCertsFromPEM(data)
	}
	client := &http.Client{Timeout: 5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	for {
		req, _ := http.NewRequest("GET", serverURL+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				emit(map[string]any{"ready": true, "url": serverURL, "kubeconfig": files.kubeconfig,
					"token": token, "ca": files.cert, "pid": os.Getpid(),
					"kubernetes": kubernetesVersion})
				return
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
}
