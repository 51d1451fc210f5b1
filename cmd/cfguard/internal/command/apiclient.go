package command

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/cfguard/cfguard/internal/cli"
	"github.com/cfguard/cfguard/stream"
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

// askedForCert is the hint when the daemon asked for a client certificate and none was given.
const askedForCert = "the daemon asks for a client certificate of its client_ca_file (http.web_config_file): give one with --cert and --key"

// client returns the HTTP client the flags describe; an error names the flag and its file. A
// request that fails after a handshake in which the daemon asked for a client certificate and got
// none, or one not of its CAs, fails with a *clientCertError: the daemon may drop the connection
// before its TLS alert is read, and the error the client sees then (a reset, a broken pipe, EOF)
// does not say why.
func (a apiTLS) client() (*http.Client, error) {
	if (*a.cert == "") != (*a.key == "") {
		return nil, fmt.Errorf("%w: --cert and --key go together: give both or neither", cli.ErrUsage)
	}
	t, err := stream.LoadTLSNamed(stream.TLSNames{CA: "--ca", Cert: "--cert", Key: "--key"},
		stream.TLSFiles{Enabled: true, CAFile: *a.ca, CertFile: *a.cert, KeyFile: *a.key})
	if err != nil {
		return nil, err
	}
	refused := &clientCertRefusal{}
	// crypto/tls's own choice: the certificate when it is of a CA the daemon names, else none.
	t.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
		switch {
		case len(t.Certificates) == 0:
			refused.set(askedForCert)
		case cri.SupportsCertificate(&t.Certificates[0]) != nil:
			refused.set(fmt.Sprintf("--cert %s is not of a CA of the daemon's client_ca_file (http.web_config_file): give one with --cert and --key", *a.cert))
		default:
			return &t.Certificates[0], nil
		}
		return &tls.Certificate{}, nil
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = t
	return &http.Client{Transport: certRefusalTransport{tr, refused}}, nil
}

// clientCertRefusal is what a handshake found wrong with the client certificate, "" when nothing.
type clientCertRefusal struct {
	mu   sync.Mutex
	hint string
}

func (c *clientCertRefusal) set(hint string) { c.mu.Lock(); c.hint = hint; c.mu.Unlock() }

func (c *clientCertRefusal) get() string { c.mu.Lock(); defer c.mu.Unlock(); return c.hint }

// clientCertError is a request's error after the daemon asked for a client certificate it did not
// get; Hint says what to do.
type clientCertError struct {
	Err  error
	Hint string
}

func (e *clientCertError) Error() string { return e.Err.Error() }
func (e *clientCertError) Unwrap() error { return e.Err }

// certRefusalTransport gives a failed request's error the client certificate's refusal, if any.
type certRefusalTransport struct {
	http.RoundTripper
	refused *clientCertRefusal
}

func (t certRefusalTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.RoundTripper.RoundTrip(r)
	var op *net.OpError
	switch {
	case err == nil:
		// The daemon took the connection as it was: its client certificate is optional.
		t.refused.set("")
	case errors.As(err, &op) && op.Op == "dial":
		// No handshake: the daemon is not there.
	default:
		if hint := t.refused.get(); hint != "" {
			err = &clientCertError{Err: err, Hint: hint}
		}
	}
	return resp, err
}

// tlsHint says what to do when err is the TLS handshake with the daemon failing, else "": its
// certificate not trusted here, or its web configuration refusing the client certificate this
// command presented (none, or one of another CA).
func tlsHint(err error) string {
	var unknown x509.UnknownAuthorityError
	var verify *tls.CertificateVerificationError
	var refused *clientCertError
	switch msg := err.Error(); {
	case errors.As(err, &refused):
		return refused.Hint
	case errors.As(err, &unknown) || errors.As(err, &verify):
		return "the daemon's certificate (http.web_config_file) is not trusted here: give its CA with --ca or in SSL_CERT_FILE, or add it to the system's CAs"
	case strings.Contains(msg, "tls: certificate required") || strings.Contains(msg, "tls: bad certificate") ||
		strings.Contains(msg, "tls: unknown certificate authority"):
		return askedForCert
	}
	return ""
}
