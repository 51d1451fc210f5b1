package command

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"

	"github.com/cfguard/cfguard/internal/cli"
)

// apiTLS holds the TLS flags of a command that asks a daemon's API (backup, import-ces): the CAs
// its certificate is checked against and the client certificate presented to a web configuration
// that asks for one (client_auth_type in http.web_config_file).
type apiTLS struct {
	ca, cert, key *string
}

// addAPITLSFlags defines --ca, --cert and --key on fs.
func addAPITLSFlags(fs *flag.FlagSet) apiTLS {
	return apiTLS{
		ca:   fs.String("ca", "", "PEM file of the CAs the daemon's certificate is checked against (default: the system's, and SSL_CERT_FILE)"),
		cert: fs.String("cert", "", "PEM client certificate to present, where http.web_config_file requires one (with --key)"),
		key:  fs.String("key", "", "PEM key of --cert"),
	}
}

// client returns the HTTP client the flags describe; an error names the flag and its file.
func (a apiTLS) client() (*http.Client, error) {
	if *a.ca == "" && *a.cert == "" && *a.key == "" {
		return &http.Client{}, nil
	}
	t := &tls.Config{MinVersion: tls.VersionTLS12}
	if *a.ca != "" {
		pem, err := os.ReadFile(*a.ca)
		if err != nil {
			return nil, fmt.Errorf("--ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--ca: %s holds no PEM certificate", *a.ca)
		}
		t.RootCAs = pool
	}
	switch {
	case *a.cert == "" && *a.key == "":
	case *a.cert == "" || *a.key == "":
		return nil, fmt.Errorf("%w: --cert and --key go together: give both or neither", cli.ErrUsage)
	default:
		cert, err := tls.LoadX509KeyPair(*a.cert, *a.key)
		if err != nil {
			return nil, fmt.Errorf("--cert %s / --key %s: %w", *a.cert, *a.key, err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = t
	return &http.Client{Transport: tr}, nil
}

// tlsHint says what to do when err is the TLS handshake with the daemon failing, else "": its
// certificate not trusted here, or its web configuration refusing the client certificate this
// command presented (none, or one of another CA).
func tlsHint(err error) string {
	var unknown x509.UnknownAuthorityError
	var verify *tls.CertificateVerificationError
	switch msg := err.Error(); {
	case errors.As(err, &unknown) || errors.As(err, &verify):
		return "the daemon's certificate (http.web_config_file) is not trusted here: give its CA with --ca or in SSL_CERT_FILE, or add it to the system's CAs"
	case strings.Contains(msg, "tls: certificate required") || strings.Contains(msg, "tls: bad certificate") ||
		strings.Contains(msg, "tls: unknown certificate authority"):
		return "the daemon asks for a client certificate of its client_ca_file (http.web_config_file): give one with --cert and --key"
	}
	return ""
}
