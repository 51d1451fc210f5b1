package replica

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
)

// PeerTransport: without replication.peer_tls, the system's roots and no client certificate;
// with it, the CA file's pool and the client certificate; a bad file is an error naming the key.
func TestPeerTransport(t *testing.T) {
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "peer"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	cert, keyFile, junk := filepath.Join(dir, "peer.pem"), filepath.Join(dir, "peer.key"), filepath.Join(dir, "junk.pem")
	for p, b := range map[string][]byte{cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		keyFile: pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), junk: []byte("not PEM")} {
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
