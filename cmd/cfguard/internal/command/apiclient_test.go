package command

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/cli"
	"github.com/cfguard/cfguard/internal/testcert"
)

// A daemon whose web configuration requires client certificates (client_auth_type
// RequireAndVerifyClientCert) is asked by backup and import-ces with the certificate of --cert
// and --key, checked against --ca; without one, or with one of another CA, the refusal says to
// give them. The flags' own mistakes name the flag.
func TestClientsPresentACertificateWhereTheDaemonAsksForOne(t *testing.T) {
	ca, other := testcert.NewCA(t, "cfguard test CA"), testcert.NewCA(t, "another CA")
	f := &fakeBulk{}
	srv := httptest.NewUnstartedServer(f)
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{ca.KeyPair(t, 2, x509.ExtKeyUsageServerAuth)},
		ClientCAs: ca.Pool(), ClientAuth: tls.RequireAndVerifyClientCert}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes are this test's point
	srv.StartTLS()
	t.Cleanup(srv.Close)

	dir, write := tempWriter(t)
	caFile := write("ca.pem", ca.PEM)
	certPEM, keyPEM := ca.Issue(t, 3, x509.ExtKeyUsageClientAuth)
	cert, key := write("client.pem", certPEM), write("client.key", keyPEM)
	otherPEM, otherKey := other.Issue(t, 4, x509.ExtKeyUsageClientAuth)
	foreign, foreignKey := write("foreign.pem", otherPEM), write("foreign.key", otherKey)
	web := write("web.yml", []byte("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n"))
	cfg := write("config.yaml", []byte("http:\n  listen: "+srv.Listener.Addr().String()+"\n  web_config_file: "+web+"\n"))

	run := func(cmd string, flags ...string) error {
		var stdout, stderr strings.Builder
		if cmd == "backup" {
			out := filepath.Join(dir, "backup.db")
			os.Remove(out)
			return cmdBackup(context.Background(), append([]string{"--config", cfg, "--out", out}, flags...), &stdout, &stderr)
		}
		return cmdImportCEs(context.Background(), append([]string{"--config", cfg, "--from", ceFile(t, 2), "--progress", "1h"}, flags...), &stdout, &stderr)
	}
	for _, cmd := range []string{"import-ces", "backup"} {
		for _, c := range []struct {
			name  string
			flags []string
			want  string
		}{
			{"no certificate", []string{"--ca", caFile}, "give one with --cert and --key"},
			{"a certificate of another CA", []string{"--ca", caFile, "--cert", foreign, "--key", foreignKey}, "give one with --cert and --key"},
			{"the daemon's CA not given", []string{"--cert", cert, "--key", key}, "give its CA with --ca"},
			{"a --ca file that is no PEM", []string{"--ca", cert + "x"}, "--ca: open " + cert + "x"},
			{"a --ca of no certificate", []string{"--ca", key}, "--ca: " + key + " holds no PEM certificate"},
			{"a --key that is no key", []string{"--ca", caFile, "--cert", cert, "--key", caFile}, "--cert " + cert + " / --key " + caFile},
		} {
			if err := run(cmd, c.flags...); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%s with %s: %v, want an error saying %q", cmd, c.name, err, c.want)
			}
		}
		if err := run(cmd, "--ca", caFile, "--cert", cert); !errors.Is(err, cli.ErrUsage) || !strings.Contains(err.Error(), "--cert and --key go together") {
			t.Errorf("%s with --cert alone: %v, want a usage error", cmd, err)
		}
	}
	if len(f.paths) != 0 {
		t.Fatalf("the daemon answered %v without a client certificate of its CA", f.paths)
	}
	// With the client certificate, both reach the daemon: import-ces stores its lines, backup
	// gets an answer (which is no ledger, from this stand-in daemon, and is refused as such).
	if err := run("import-ces", "--ca", caFile, "--cert", cert, "--key", key); err != nil {
		t.Fatalf("import-ces with the client certificate: %v", err)
	}
	if total, _ := f.lines(); total != 2 {
		t.Errorf("import-ces with the client certificate sent %d lines, want 2", total)
	}
	if err := run("backup", "--ca", caFile, "--cert", cert, "--key", key); err == nil || !strings.Contains(err.Error(), "verif") {
		t.Errorf("backup with the client certificate: %v, want the stand-in's answer refused as no ledger", err)
	}
	if !slices.Contains(f.paths, "GET /v1/backup") {
		t.Errorf("requests %v, want GET /v1/backup among them", f.paths)
	}
}

// A daemon that refuses the client certificate may close the connection before its TLS alert is
// read (the client then sees a reset, a broken pipe or EOF): the refusal still says that the
// daemon asked for a client certificate, and whether none was given or the one given is of
// another CA, not that the daemon may be down.
func TestARefusedClientCertificateIsNamedWithoutTheAlert(t *testing.T) {
	ca, other := testcert.NewCA(t, "cfguard test CA"), testcert.NewCA(t, "another CA")
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{ca.KeyPair(t, 2, x509.ExtKeyUsageServerAuth)},
		ClientCAs: ca.Pool(), ClientAuth: tls.VerifyClientCertIfGiven})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			// The handshake, then a close with no alert and no answer, as a daemon that
			// drops a client without a certificate before the client reads its alert.
			tc := c.(*tls.Conn)
			_ = tc.Handshake()
			if raw, ok := tc.NetConn().(*net.TCPConn); ok {
				_ = raw.SetLinger(0)
			}
			c.Close()
		}
	}()
	dir, write := tempWriter(t)
	caFile := write("ca.pem", ca.PEM)
	otherPEM, otherKey := other.Issue(t, 4, x509.ExtKeyUsageClientAuth)
	foreign, foreignKey := write("foreign.pem", otherPEM), write("foreign.key", otherKey)
	cfg := write("config.yaml", []byte("http:\n  listen: "+ln.Addr().String()+"\n"))
	url := "https://" + ln.Addr().String()
	run := func(cmd string, flags ...string) error {
		var stdout, stderr strings.Builder
		if cmd == "backup" {
			return cmdBackup(context.Background(), append([]string{"--config", cfg, "--url", url, "--out", filepath.Join(dir, "backup.db")}, flags...), &stdout, &stderr)
		}
		return cmdImportCEs(context.Background(), append([]string{"--config", cfg, "--url", url, "--from", ceFile(t, 2), "--progress", "1h"}, flags...), &stdout, &stderr)
	}
	for _, cmd := range []string{"import-ces", "backup"} {
		if err := run(cmd, "--ca", caFile); err == nil || !strings.Contains(err.Error(), "give one with --cert and --key") {
			t.Errorf("%s without a certificate: %v, want it to say to give one with --cert and --key", cmd, err)
		}
		want := "--cert " + foreign + " is not of a CA of the daemon's client_ca_file"
		if err := run(cmd, "--ca", caFile, "--cert", foreign, "--key", foreignKey); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s with a certificate of another CA: %v, want it to say %q", cmd, err, want)
		}
	}
}

// tempWriter returns a temporary directory and a function that writes a file into it and
// returns the file's path.
func tempWriter(t *testing.T) (string, func(name string, b []byte) string) {
	dir := t.TempDir()
	return dir, func(name string, b []byte) string {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
}
