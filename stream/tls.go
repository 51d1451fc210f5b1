package stream

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
)

// TLSFiles is the Kafka client's TLS configuration as files on disk: the kafka.tls section of
// the configuration (config.TLS converts to it).
type TLSFiles struct {
	// Enabled turns TLS on; without it the other fields are ignored.
	Enabled bool
	// CAFile is a PEM bundle of the certificates that may sign the brokers' certificates.
	// Default: "" (the system's roots).
	CAFile string
	// CertFile and KeyFile are the client's certificate and key (PEM), for brokers that
	// require client certificates. Both or neither.
	CertFile, KeyFile string
	// InsecureSkipVerify accepts any broker certificate. For tests only.
	InsecureSkipVerify bool
}

// LoadTLS reads the files and returns the client TLS configuration (TLS 1.2 or later), or nil
// when f.Enabled is false. Errors name the configuration key (kafka.tls.ca_file, ...) and the
// file.
func LoadTLS(f TLSFiles) (*tls.Config, error) { return LoadTLSAt("kafka.tls", f) }

// LoadTLSAt is LoadTLS for the files of configuration section section (kafka.tls,
// replication.peer_tls), which its errors name.
func LoadTLSAt(section string, f TLSFiles) (*tls.Config, error) {
	if !f.Enabled {
		return nil, nil
	}
	t := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: f.InsecureSkipVerify}
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%s.ca_file: %w", section, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s.ca_file: %s holds no PEM certificate", section, f.CAFile)
		}
		t.RootCAs = pool
	}
	switch {
	case f.CertFile == "" && f.KeyFile == "":
	case f.CertFile == "":
		return nil, fmt.Errorf("%[1]s.cert_file: empty, but %[1]s.key_file is set: give both or neither", section)
	case f.KeyFile == "":
		return nil, fmt.Errorf("%[1]s.key_file: empty, but %[1]s.cert_file is set: give both or neither", section)
	default:
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("%[1]s.cert_file %[2]s / %[1]s.key_file %[3]s: %[4]w", section, f.CertFile, f.KeyFile, err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}
