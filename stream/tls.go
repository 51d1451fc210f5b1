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
	return LoadTLSNamed(TLSNames{CA: section + ".ca_file", Cert: section + ".cert_file", Key: section + ".key_file"}, f)
}

// TLSNames are what errors call the three files: configuration keys, or a command's flags.
type TLSNames struct{ CA, Cert, Key string }

// LoadTLSNamed is LoadTLS with the files named as names says.
func LoadTLSNamed(names TLSNames, f TLSFiles) (*tls.Config, error) {
	if !f.Enabled {
		return nil, nil
	}
	t := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: f.InsecureSkipVerify}
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", names.CA, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s: %s holds no PEM certificate", names.CA, f.CAFile)
		}
		t.RootCAs = pool
	}
	switch {
	case f.CertFile == "" && f.KeyFile == "":
	case f.CertFile == "":
		return nil, fmt.Errorf("%s: empty, but %s is set: give both or neither", names.Cert, names.Key)
	case f.KeyFile == "":
		return nil, fmt.Errorf("%s: empty, but %s is set: give both or neither", names.Key, names.Cert)
	default:
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("%s %s / %s %s: %w", names.Cert, f.CertFile, names.Key, f.KeyFile, err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}
