package replica

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/testcert"
)

// PeerTransport: without replication.peer_tls, the system's roots and no client certificate;
// with it, the CA file's pool and the client certificate; a bad file is an error naming the key.
func TestPeerTransport(t *testing.T) {
	dir := t.TempDir()
	ca := testcert.NewCA(t, "peer") // its own certificate serves as the client's too
	cert, keyFile, junk := filepath.Join(dir, "peer.pem"), filepath.Join(dir, "peer.key"), filepath.Join(dir, "junk.pem")
	for p, b := range map[string][]byte{cert: ca.PEM, keyFile: ca.KeyPEM(t), junk: []byte("not PEM")} {
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	tr, err := PeerTransport(config.Replication{})
	if err != nil {
		t.Fatal(err)
	}
	if c := tr.TLSClientConfig; c != nil && (c.RootCAs != nil || len(c.Certificates) > 0) {
		t.Fatalf("without peer_tls: TLS %+v; want the system's roots and no client certificate", c)
	}
	tr, err = PeerTransport(config.Replication{PeerTLS: config.PeerTLS{CAFile: cert, CertFile: cert, KeyFile: keyFile}})
	if err != nil {
		t.Fatal(err)
	}
	if c := tr.TLSClientConfig; c == nil || c.RootCAs == nil || len(c.Certificates) != 1 {
		t.Fatalf("with peer_tls: TLS %+v; want the CA pool and one client certificate", c)
	}
	if _, err := PeerTransport(config.Replication{PeerTLS: config.PeerTLS{CAFile: junk}}); err == nil ||
		!strings.Contains(err.Error(), "replication.peer_tls.ca_file") {
		t.Fatalf("a CA file without PEM: %v; want an error naming replication.peer_tls.ca_file", err)
	}
}
