package daemon

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
	"errors"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
)

// testCA issues certificates for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a PEM certificate and key for 127.0.0.1 (a server) or a client.
func (ca *testCA) issue(t *testing.T, serial int64, usage x509.ExtKeyUsage) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "cfguard-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

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
func tlsClient(t *testing.T, ca *testCA, certPEM, keyPEM []byte) *http.Client {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.pem)
	cfg := &tls.Config{RootCAs: pool}
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
	ca := newTestCA(t, "cfguard test CA")
	serverCert, serverKey := ca.issue(t, 100, x509.ExtKeyUsageServerAuth)
	clientCert, clientKey := ca.issue(t, 200, x509.ExtKeyUsageClientAuth)
	for name, b := range map[string][]byte{"ca.pem": ca.pem, "server.pem": serverCert, "server.key": serverKey,
		"web.yml": []byte("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n" +
			"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n")} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	client := tlsClient(t, ca, clientCert, clientKey)
	r := startDaemonClient(t, func(c *config.Config) {
		c.HTTP.WebConfigFile = filepath.Join(dir, "web.yml")
		c.HTTP.MetricsToken = "m3trics"
	}, client) // waits for /readyz over HTTPS

	servedSerial := func() int64 {
		t.Helper()
		resp, err := client.Get(r.base + "/healthz")
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
	resp, body := r.rawDo(t, "GET", "/metrics", "", map[string]string{"Authorization": "Bearer m3trics"})
	if resp.StatusCode != 200 || resp.TLS == nil || !bytes.Contains(body, []byte("cfguard_posterior_version")) {
		t.Fatalf("/metrics over HTTPS: %d", resp.StatusCode)
	}

	// Plain HTTP reaches no handler.
	if resp, err := http.Get("http://" + r.d.HTTPAddr() + "/healthz"); err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 || bytes.Contains(b, []byte(`"status"`)) {
			t.Fatalf("plain HTTP to the TLS listener: %d %s", resp.StatusCode, b)
		}
	}
	// No client certificate, or one the client CA did not sign: no answer.
	other := newTestCA(t, "another CA")
	otherCert, otherKey := other.issue(t, 300, x509.ExtKeyUsageClientAuth)
	for name, c := range map[string]*http.Client{"no client certificate": tlsClient(t, ca, nil, nil),
		"a client certificate of another CA": tlsClient(t, ca, otherCert, otherKey)} {
		resp, err := c.Get(r.base + "/healthz")
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
	renewed, renewedKey := ca.issue(t, 101, x509.ExtKeyUsageServerAuth)
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
		err = Run(context.Background(), Options{Config: &cfg, Logger: slog.New(slog.DiscardHandler)})
		if !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Run: %v, want an invalid http.web_config_file naming %s", c.name, err, c.want)
		}
		if _, serr := os.Stat(filepath.Join(cfg.StateDir, "cfguard.db")); serr == nil {
			t.Errorf("%s: Run opened the ledger before refusing the web configuration", c.name)
		}
	}
}
