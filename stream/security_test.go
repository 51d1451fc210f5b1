package stream

import (
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/testcert"
)

// selfSigned returns a server TLS config with a fresh certificate for 127.0.0.1 and a client
// TLS config that trusts exactly the CA that issued it.
func selfSigned(t *testing.T) (server, client *tls.Config) {
	t.Helper()
	ca := testcert.NewCA(t, "cfguard test broker CA")
	server = &tls.Config{Certificates: []tls.Certificate{ca.KeyPair(t, 2, x509.ExtKeyUsageServerAuth)}, MinVersion: tls.VersionTLS12}
	client = &tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS12}
	return server, client
}

// roundTrip produces three records over conn and consumes them with a Consumer over conn.
func roundTrip(t *testing.T, conn ConnConfig, group string) {
	t.Helper()
	produce(t, conn, recordsTopic, 0, goodRecords(group, 3)...)
	c := newConsumer(t, consumerConfig(conn, group))
	incs := collect(t, c, 3, 20*time.Second)
	if got, want := ids(incs), []string{group + "0", group + "1", group + "2"}; !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for _, inc := range incs {
		c.MarkDurable(inc)
	}
}

func pingFails(t *testing.T, conn ConnConfig, why string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn.DialTimeout = 2 * time.Second
	if err := Ping(ctx, conn, recordsTopic); err == nil {
		t.Fatalf("Ping succeeded %s", why)
	} else {
		t.Logf("Ping %s: %v", why, err)
	}
}

func TestTLS(t *testing.T) {
	server, client := selfSigned(t)
	b := startBroker(t, broker.Config{TLS: server})
	conn := plainConn(b)
	conn.TLS = client
	if err := Ping(context.Background(), conn, recordsTopic, deadTopic); err != nil {
		t.Fatalf("Ping over TLS: %v", err)
	}
	roundTrip(t, conn, "tls")

	pingFails(t, plainConn(b), "without TLS against a TLS listener")
	_, other := selfSigned(t)
	untrusted := plainConn(b)
	untrusted.TLS = other
	pingFails(t, untrusted, "trusting a different certificate")
}

func TestSASL(t *testing.T) {
	for _, mech := range []string{MechanismPlain, MechanismScramSHA256, MechanismScramSHA512} {
		t.Run(mech, func(t *testing.T) {
			b := startBroker(t, broker.Config{SASL: &broker.SASLConfig{Mechanism: mech, User: "cfguard", Password: "s3cret"}})
			conn := plainConn(b)
			conn.SASL = &SASL{Mechanism: mech, User: "cfguard", Password: "s3cret"}
			if err := Ping(context.Background(), conn, recordsTopic); err != nil {
				t.Fatalf("Ping with %s: %v", mech, err)
			}
			roundTrip(t, conn, "sasl")

			wrong := plainConn(b)
			wrong.SASL = &SASL{Mechanism: mech, User: "cfguard", Password: "guess"}
			pingFails(t, wrong, "with a wrong password")
			pingFails(t, plainConn(b), "without SASL")
		})
	}
}

func TestSASLOverTLS(t *testing.T) {
	server, client := selfSigned(t)
	sasl := broker.SASLConfig{Mechanism: MechanismScramSHA512, User: "cfguard", Password: "s3cret"}
	b := startBroker(t, broker.Config{TLS: server, SASL: &sasl})
	conn := plainConn(b)
	conn.TLS = client
	conn.SASL = (*SASL)(&sasl) // the two config types convert
	roundTrip(t, conn, "both")
}

// writePEM writes the server's certificate (and key) of a selfSigned config as PEM files.
func writePEM(t *testing.T, server *tls.Config) (certFile, keyFile string) {
	t.Helper()
	dir := t.TempDir()
	cert := server.Certificates[0]
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	der, err := x509.MarshalECPrivateKey(cert.PrivateKey.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Certificate[0]}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

// TestLoadTLS builds client configurations from files: one that trusts the broker's CA file
// talks to a TLS broker; bad files give errors that name the configuration key.
func TestLoadTLS(t *testing.T) {
	server, _ := selfSigned(t)
	certFile, keyFile := writePEM(t, server)
	if c, err := LoadTLS(TLSFiles{CAFile: certFile}); c != nil || err != nil {
		t.Fatalf("disabled: %v, %v; want nil, nil", c, err)
	}
	client, err := LoadTLS(TLSFiles{Enabled: true, CAFile: certFile, CertFile: certFile, KeyFile: keyFile})
	if err != nil {
		t.Fatal(err)
	}
	if client.MinVersion != tls.VersionTLS12 || len(client.Certificates) != 1 {
		t.Fatalf("client config %+v", client)
	}
	b := startBroker(t, broker.Config{TLS: server})
	conn := plainConn(b)
	conn.TLS = client
	if err := Ping(context.Background(), conn, recordsTopic); err != nil {
		t.Fatalf("Ping with LoadTLS's config: %v", err)
	}
	garbage := filepath.Join(t.TempDir(), "garbage.pem")
	os.WriteFile(garbage, []byte("not a certificate"), 0o600)
	for _, tc := range []struct {
		name    string
		section string // LoadTLSAt's; "": LoadTLS
		files   TLSFiles
		want    string
	}{
		{"missing CA file", "", TLSFiles{CAFile: filepath.Join(t.TempDir(), "nope.pem")}, "kafka.tls.ca_file"},
		{"CA file without PEM", "", TLSFiles{CAFile: garbage}, "kafka.tls.ca_file: " + garbage + " holds no PEM"},
		{"cert without key", "", TLSFiles{CertFile: certFile}, "kafka.tls.key_file: empty, but kafka.tls.cert_file is set"},
		{"key without cert", "", TLSFiles{KeyFile: keyFile}, "kafka.tls.cert_file: empty, but kafka.tls.key_file is set"},
		{"bad key pair", "", TLSFiles{CertFile: certFile, KeyFile: garbage}, "kafka.tls.cert_file " + certFile + " / kafka.tls.key_file " + garbage},
		{"another section's CA file", "replication.peer_tls", TLSFiles{CAFile: garbage}, "replication.peer_tls.ca_file: " + garbage},
		{"another section's key pair", "replication.peer_tls", TLSFiles{CertFile: garbage, KeyFile: keyFile},
			"replication.peer_tls.cert_file " + garbage + " / replication.peer_tls.key_file " + keyFile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.files.Enabled = true
			load := LoadTLS
			if tc.section != "" {
				load = func(f TLSFiles) (*tls.Config, error) { return LoadTLSAt(tc.section, f) }
			}
			c, err := load(tc.files)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("LoadTLS = %v, %v; want an error containing %q", c, err, tc.want)
			}
		})
	}
}
