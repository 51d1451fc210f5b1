package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/prometheus/exporter-toolkit/web"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/stream"
)

// CheckFiles checks that the files the configuration names exist and are what they should be:
// model.path a directory with the model's two files (CheckModel loads them), another directory
// than model.export_dir, the TLS files readable, with replication
// enabled a readable key file (replication.key_file). Validate does not
// touch the file system; LoadFile calls both.
func (c *Config) CheckFiles() error {
	var errs []error
	if c.Model.Path != "" {
		for _, name := range []string{"model.json", "model.safetensors"} {
			p := filepath.Join(c.Model.Path, name)
			if st, err := os.Stat(p); err != nil {
				errs = append(errs, fmt.Errorf("model.path: %s: %w (a model directory holds model.json and model.safetensors; see cfguard train and cfguard import)", c.Model.Path, err))
				break
			} else if !st.Mode().IsRegular() {
				errs = append(errs, fmt.Errorf("model.path: %s is not a regular file", p))
			}
		}
		if sameDir(c.Model.Path, c.ExportDir()) {
			errs = append(errs, fmt.Errorf("model.export_dir: %s is model.path's directory: each promoted posterior would overwrite "+
				"the model this state directory began from; name another directory", c.ExportDir()))
		}
	}
	for _, d := range []struct{ key, path string }{{"state_dir", c.StateDir}, {"model.export_dir", c.ExportDir()}} {
		if st, err := os.Stat(d.path); err == nil && !st.IsDir() {
			errs = append(errs, fmt.Errorf("%s: %s is not a directory: name a directory, or move the file aside", d.key, d.path))
		}
	}
	opened := len(errs)
	for _, tf := range []struct{ key, path string }{{"kafka.tls.ca_file", c.Kafka.TLS.CAFile}, {"kafka.tls.cert_file", c.Kafka.TLS.CertFile}, {"kafka.tls.key_file", c.Kafka.TLS.KeyFile}} {
		if tf.path == "" {
			continue
		}
		if f, err := os.Open(tf.path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", tf.key, err))
		} else {
			f.Close()
		}
	}
	if c.Kafka.TLS.Enabled && len(errs) == opened { // every file opens: parsed as run parses them
		if _, err := stream.LoadTLS(stream.TLSFiles(c.Kafka.TLS)); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.checkWebConfig(); err != nil {
		errs = append(errs, err)
	}
	if c.Replication.Enabled {
		// Checked here, after the environment's override, not in Validate: in Kubernetes the
		// file's path comes from CFGUARD_REPLICATION_KEY_FILE.
		if _, err := clusterkey.Load(c.Replication.KeyFile); err != nil {
			errs = append(errs, err)
		}
		if _, err := stream.LoadTLSAt("replication.peer_tls", c.Replication.PeerTLS.Files()); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// tokenProblem says why no client could present v as "Authorization: Bearer <v>", or "" when one
// can: an HTTP header value holds no control character but the tab (a token read from a file
// often keeps its file's last newline), and loses the spaces and tabs at its end.
func tokenProblem(v string) string {
	for i, r := range v {
		if (r < 0x20 && r != '\t') || r == 0x7f {
			what := fmt.Sprintf("a control character (%U) at byte %d", r, i)
			if r == '\n' && i == len(v)-1 {
				what = "a newline at its end (the last line of the file it was read from?)"
			}
			return "holds " + what + ", which no HTTP header can carry, so no client could send it; remove it " +
				"(a Kubernetes Secret: kubectl create secret generic --from-literal, or a file written with printf '%s')"
		}
	}
	if strings.TrimRight(v, " \t") != v {
		return "ends with a space or a tab, which HTTP drops from a header's value, so no client could send it; remove it"
	}
	return ""
}

// CheckModel loads model.path's model as run loads it, so that a model run would refuse (cut
// short, corrupt, invalid) is refused with the key that names it. LoadFile does not: every
// command loads the configuration, and only check-config and run need the model (a large one
// takes a fraction of a second to decode).
func (c *Config) CheckModel() error {
	if c.Model.Path == "" {
		return nil
	}
	if _, err := bnn.Load(c.Model.Path); err != nil {
		return fmt.Errorf("%w: model.path: %w", ErrInvalid, err)
	}
	return nil
}

// sameDir reports whether a and b name one directory: the same path once cleaned and made
// absolute, or, when both exist, the same file (a symbolic link or a bind mount to it).
func sameDir(a, b string) bool {
	if aa, err := filepath.Abs(a); err == nil {
		if bb, err := filepath.Abs(b); err == nil && aa == bb {
			return true
		}
	}
	sa, errA := os.Stat(a)
	sb, errB := os.Stat(b)
	return errA == nil && errB == nil && os.SameFile(sa, sb)
}

// CheckWebConfig checks http.web_config_file as the exporter-toolkit reads it, the certificates
// and keys it names included, so that a mistake stops the start rather than the first
// handshake; and that it does not ask for basic auth beside http.token or http.metrics_token,
// which would need the same Authorization header. CheckFiles calls it.
func (c *Config) CheckWebConfig() error {
	if err := c.checkWebConfig(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

func (c *Config) checkWebConfig() error {
	p := c.HTTP.WebConfigFile
	if p == "" {
		return nil
	}
	if err := web.Validate(p); err != nil {
		return fmt.Errorf("http.web_config_file: %s: %w (the format: https://prometheus.io/docs/prometheus/latest/configuration/https/)", p, err)
	}
	wc, err := readWebConfig(p)
	if err != nil {
		return fmt.Errorf("http.web_config_file: %w", err)
	}
	if len(wc.Users) > 0 && (c.HTTP.Token != "" || c.HTTP.MetricsToken != "") {
		return fmt.Errorf("http.web_config_file: %s sets basic_auth_users while http.token or http.metrics_token is set: "+
			"both need the Authorization header, so keep one of them (basic auth guards every route, /healthz and /readyz too)", p)
	}
	if len(wc.Users) > 0 && c.Replication.Enabled {
		return fmt.Errorf("http.web_config_file: %s sets basic_auth_users on a replica (replication.enabled): the replicas ask "+
			"each other with the client's bearer token, which basic auth refuses; guard the API with http.token, and with TLS "+
			"client certificates (replication.peer_tls)", p)
	}
	return nil
}

// ServesTLS says whether http.web_config_file serves the API over TLS (a tls_server_config
// with a certificate): the default replication.advertise_url is then https://. False without
// the file, or when it cannot be read (CheckWebConfig reports that).
func (c *Config) ServesTLS() bool {
	if c.HTTP.WebConfigFile == "" {
		return false
	}
	wc, err := readWebConfig(c.HTTP.WebConfigFile)
	return err == nil && (wc.TLS.CertFile != "" || wc.TLS.Cert != "")
}

// webConfig is what cfguard reads itself of an exporter-toolkit web configuration file
// (web.Validate checks the whole of it).
type webConfig struct {
	Users map[string]any `yaml:"basic_auth_users"`
	TLS   struct {
		CertFile string `yaml:"cert_file"`
		Cert     string `yaml:"cert"`
	} `yaml:"tls_server_config"`
}

// readWebConfig reads the web configuration file at path.
func readWebConfig(path string) (webConfig, error) {
	var wc webConfig
	b, err := os.ReadFile(path)
	if err != nil {
		return wc, err
	}
	return wc, yaml.Unmarshal(b, &wc)
}
