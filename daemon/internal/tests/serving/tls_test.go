package serving

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/testcert"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// replaceFile writes a file as a certificate renewal does: a new file renamed over the old.
func replaceFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path+".new", b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
}

// tlsClient speaks TLS to the daemon, trusting ca, presenting the client certificate when
// given, one connection (one handshake) per request.
func tlsClient(t *testing.T, ca *testcert.CA, certPEM, keyPEM []byte) *http.Client {
	t.Helper()
	cfg := &tls.Config{RootCAs: ca.Pool()}
	if certPEM != nil {
		c, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg, DisableKeepAlives: true}, Timeout: 20 * time.Second}
}

// TestTLSAndClientCertificatesFromTheWebConfig: with http.web_config_file asking for TLS and
// client certificates, the API and /metrics answer over HTTPS to a client with a certificate
// of the client CA; plain HTTP, a client without a certificate and one with a certificate of
// another CA are refused; a renewed server certificate is served without a restart.
func TestTLSAndClientCertificatesFromTheWebConfig(t *testing.T) {
	dir := t.TempDir()
	ca := testcert.NewCA(t, "cfguard test CA")
	serverCert, serverKey := ca.Issue(t, 100, x509.ExtKeyUsageServerAuth)
	clientCert, clientKey := ca.Issue(t, 200, x509.ExtKeyUsageClientAuth)
	for name, b := range map[string][]byte{"ca.pem": ca.PEM, "server.pem": serverCert, "server.key": serverKey,
		"web.yml": []byte("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n" +
			"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n")} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	client := tlsClient(t, ca, clientCert, clientKey)
	r := launch.TLS(t, func(c *config.Config) {
		c.HTTP.WebConfigFile = filepath.Join(dir, "web.yml")
		c.HTTP.MetricsToken = "m3trics"
	}, client) // waits for /readyz over HTTPS

	servedSerial := func() int64 {
		t.Helper()
		resp, err := client.Get(r.Base + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.TLS == nil {
			t.Fatalf("/healthz over HTTPS: %d", resp.StatusCode)
		}
		return resp.TLS.PeerCertificates[0].SerialNumber.Int64()
	}
	if s := servedSerial(); s != 100 {
		t.Fatalf("served certificate serial %d, want 100", s)
	}
	resp, body := r.RawDo(t, "GET", "/metrics", "", map[string]string{"Authorization": "Bearer m3trics"})
	if resp.StatusCode != 200 || resp.TLS == nil || !bytes.Contains(body, []byte("cfguard_posterior_version")) {
		t.Fatalf("/metrics over HTTPS: %d", resp.StatusCode)
	}

	// Plain HTTP reaches no handler.
	if resp, err := http.Get("http://" + r.D.HTTPAddr() + "/healthz"); err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 || bytes.Contains(b, []byte(`"status"`)) {
			t.Fatalf("plain HTTP to the TLS listener: %d %s", resp.StatusCode, b)
		}
	}
	// No client certificate, or one the client CA did not sign: no answer.
	other := testcert.NewCA(t, "another CA")
	otherCert, otherKey := other.Issue(t, 300, x509.ExtKeyUsageClientAuth)
	for name, c := range map[string]*http.Client{"no client certificate": tlsClient(t, ca, nil, nil),
		"a client certificate of another CA": tlsClient(t, ca, otherCert, otherKey)} {
		resp, err := c.Get(r.Base + "/healthz")
		if err == nil {
			resp.Body.Close()
			t.Fatalf("%s: %d, want the handshake refused", name, resp.StatusCode)
		}
		var alert tls.AlertError
		if !errors.As(err, &alert) && !strings.Contains(err.Error(), "certificate") {
			t.Fatalf("%s: %v, want a TLS alert about the certificate", name, err)
		}
	}

	// A renewed certificate (new key, new serial) is served on the next connection.
	renewed, renewedKey := ca.Issue(t, 101, x509.ExtKeyUsageServerAuth)
	replaceFile(t, filepath.Join(dir, "server.key"), renewedKey)
	replaceFile(t, filepath.Join(dir, "server.pem"), renewed)
	if s := servedSerial(); s != 101 {
		t.Fatalf("after the renewal: served certificate serial %d, want 101", s)
	}
}

// TestBadWebConfigStopsTheStart: a web configuration naming a certificate that is not there, or
// asking for basic auth beside http.token, is a configuration error (exit 2) naming
// http.web_config_file, found by check-config and before the daemon does any work.
func TestBadWebConfigStopsTheStart(t *testing.T) {
	const users = "basic_auth_users:\n  ops: $2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi\n"
	for _, c := range []struct {
		name, web, token, want string
	}{
		{"missing certificate", "tls_server_config:\n  cert_file: missing.pem\n  key_file: missing.key\n", "", "missing.pem"},
		{"basic auth beside http.token", users, "t0ken", "basic_auth_users"},
		{"basic auth alone", users, "", ""},
	} {
		web := filepath.Join(t.TempDir(), "web.yml")
		if err := os.WriteFile(web, []byte(c.web), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg := config.Default()
		cfg.StateDir, cfg.HTTP.Listen, cfg.Kafka.EmbeddedListen, cfg.Audit.Schedule = t.TempDir(), "127.0.0.1:0", "127.0.0.1:0", ""
		cfg.HTTP.WebConfigFile, cfg.HTTP.Token = web, c.token
		err := cfg.CheckFiles()
		if c.want == "" {
			if err != nil {
				t.Errorf("%s: CheckFiles: %v", c.name, err)
			}
			continue
		}
		if !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), "http.web_config_file") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: CheckFiles: %v, want an invalid http.web_config_file naming %s", c.name, err, c.want)
		}
		err = daemon.Run(context.Background(), daemon.Options{Config: &cfg, Logger: slog.New(slog.DiscardHandler)})
		if !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Run: %v, want an invalid http.web_config_file naming %s", c.name, err, c.want)
		}
		if _, serr := os.Stat(filepath.Join(cfg.StateDir, "cfguard.db")); serr == nil {
			t.Errorf("%s: Run opened the ledger before refusing the web configuration", c.name)
		}
	}
}

// TestReplicasAskEachOtherOverTLS: replicas whose API requires client certificates
// (http.web_config_file) reach each other with replication.peer_tls: each advertises https:// by
// default, trusts its peers' CA and presents its client certificate, so that a registration at
// r1 of a CE in a partition r2 owns is answered 201 with r2's outcome, and a read of it at r1 is
// answered by r2. A replica with the CA and no client certificate is refused by its peers: its
// read of a CE another replica owns is answered 502.
func TestReplicasAskEachOtherOverTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	t.Parallel() // mostly waits for the replicas to join their groups
	dir := t.TempDir()
	ca := testcert.NewCA(t, "cfguard test CA")
	serverCert, serverKey := ca.Issue(t, 100, x509.ExtKeyUsageServerAuth)
	clientCert, clientKey := ca.Issue(t, 200, x509.ExtKeyUsageClientAuth)
	for name, b := range map[string][]byte{"ca.pem": ca.PEM, "server.pem": serverCert, "server.key": serverKey,
		"client.pem": clientCert, "client.key": clientKey,
		"web.yml": []byte("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n" +
			"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n")} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	client := tlsClient(t, ca, clientCert, clientKey)
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	start := func(id string, peer config.PeerTLS, registerWait time.Duration) *launch.Running {
		t.Helper()
		r := launch.With(t, func(c *config.Config) {
			daemontest.ReplicaConfig(c, b.Addrs(), id, key)
			c.HTTP.WebConfigFile = filepath.Join(dir, "web.yml")
			c.Replication.PeerTLS, c.Replication.RegisterWait = peer, registerWait
		}, nil, client)
		waitfor.Cond(t, 60*time.Second, id+" ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
		return r
	}
	withCert := config.PeerTLS{CAFile: filepath.Join(dir, "ca.pem"), CertFile: filepath.Join(dir, "client.pem"), KeyFile: filepath.Join(dir, "client.key")}
	r1, r2 := start("r1", withCert, 10*time.Second), start("r2", withCert, 10*time.Second)
	parts := r1.D.Share().Partitions()
	waitfor.Cond(t, 60*time.Second, "r1 and r2 sharing the partitions", func() bool {
		return len(r1.D.Share().Member().Owned()) > 0 && len(r2.D.Share().Member().Owned()) > 0 &&
			len(r1.D.Share().Member().Owned())+len(r2.D.Share().Member().Owned()) == parts
	})
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 12, "") // each answered 201: those of r2's partitions with r2's outcome
	atR2 := 0
	for _, id := range ids {
		if slices.Contains(r2.D.Share().Member().Owned(), ceshare.Partition(id, parts)) {
			atR2++
		}
		if code, body := r1.Get(t, "/v1/counterfactuals/"+id); code != http.StatusOK {
			t.Errorf("GET %s at r1: %d %s", id, code, body)
		}
	}
	if atR2 == 0 {
		t.Fatal("no CE registered in a partition r2 owns: the test shows nothing")
	}

	r3 := start("r3", config.PeerTLS{CAFile: filepath.Join(dir, "ca.pem")}, 3*time.Second)
	var other string // a CE another replica owns
	waitfor.Cond(t, 60*time.Second, "r3 owning partitions, and a CE another replica owns", func() bool {
		owned := r3.D.Share().Member().Owned()
		for _, id := range ids {
			if len(owned) > 0 && !slices.Contains(owned, ceshare.Partition(id, parts)) {
				other = id
				return true
			}
		}
		return false
	})
	// The refusal reaches r3 as the server's alert ("certificate required") or, when r3 writes its
	// request before the alert arrives (TLS 1.3 ends the client's handshake before the server
	// checks the client's certificate), as a broken pipe or a reset: either is the peer not
	// answering.
	code, body := r3.Get(t, "/v1/counterfactuals/"+other)
	if code != http.StatusBadGateway || !strings.Contains(string(body), "a replica did not answer") || !strings.Contains(string(body), "https://") {
		t.Errorf("GET %s at r3, which presents no client certificate to its peers: %d %s, want 502 naming the peer", other, code, body)
	}
	// A registration at r3 of a CE another replica owns is sent, but r3 cannot ask for its
	// outcome: 202 after replication.register_wait, and the answer says why it does not know.
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r3.D.Posterior(), data, 400, 1)
	id := ""
	for k := 0; id == ""; k++ {
		if p := ceshare.Partition(fmt.Sprintf("tls-%d", k), parts); !slices.Contains(r3.D.Share().Member().Owned(), p) {
			id = fmt.Sprintf("tls-%d", k)
		}
	}
	code, body = r3.Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": id, "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})
	if code != http.StatusAccepted || !strings.Contains(string(body), "whether its owner applied it is not known") ||
		!strings.Contains(string(body), fmt.Sprintf(`"partition":%d`, ceshare.Partition(id, parts))) {
		t.Errorf("POST %s at r3: %d %s, want 202 saying its owner did not answer, naming partition %d", id, code, body, ceshare.Partition(id, parts))
	}
}
