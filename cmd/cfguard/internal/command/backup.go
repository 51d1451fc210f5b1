package command

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	neturl "net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/internal/cli"
	"github.com/cfguard/cfguard/ledger"
)

// cmdBackup downloads a consistent snapshot of a running daemon's ledger (GET /v1/backup, with
// http.token from the configuration), verifies it and links it into place as --out, which must
// not exist. The daemon keeps ingesting meanwhile.
func cmdBackup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("backup", flag.ContinueOnError)
	path := fs.String("config", "config.yaml", "the running daemon's configuration (http.listen, http.token)")
	out := fs.String("out", "", "file to write the backup to (must not exist)")
	url := fs.String("url", "", "the daemon's base URL (default: http://<http.listen>, https:// when http.web_config_file serves TLS; a wildcard host read as 127.0.0.1)")
	tlsFlags := addAPITLSFlags(fs)
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("out", *out); err != nil {
		return err
	}
	if err := checkURL(*url); err != nil {
		return err
	}
	client, err := tlsFlags.client()
	if err != nil {
		return err
	}
	// A client of the daemon's API: the files the configuration names are the daemon's, and
	// need not exist where this runs.
	cfg, err := config.LoadClientFile(*path)
	if err != nil {
		return err
	}
	if *url == "" {
		if *url, err = daemonURL(cfg); err != nil {
			return err
		}
	}
	if _, err := os.Lstat(*out); err == nil {
		return fmt.Errorf("%w: --out %s exists; cfguard backup never overwrites a file", cli.ErrUsage, *out)
	}
	info, err := download(ctx, client, strings.TrimSuffix(*url, "/")+"/v1/backup", cfg.HTTP.Token, *out)
	if err != nil {
		return err
	}
	return printJSON(stdout, info)
}

// download writes the backup beside out under a temporary name, fsyncs it, verifies it with
// ledger.Verify, links it into place and fsyncs out's directory; nothing is left behind on
// failure.
func download(ctx context.Context, client *http.Client, url, token, out string) (ledger.Info, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return ledger.Info{}, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		if hint := tlsHint(err); hint != "" {
			return ledger.Info{}, fmt.Errorf("backup: %w (%s)", err, hint)
		}
		return ledger.Info{}, fmt.Errorf("backup: %w (is the daemon running? a stopped daemon's ledger can be copied as a file: state_dir/%s)", err, ledger.FileName)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return ledger.Info{}, fmt.Errorf("backup: GET %s: %s: %s%s", url, resp.Status, strings.TrimSpace(string(b)), statusHint(resp.StatusCode))
	}
	tmp, err := os.CreateTemp(filepath.Dir(out), filepath.Base(out)+".partial-*")
	if err != nil {
		return ledger.Info{}, fmt.Errorf("backup: %w", err)
	}
	defer os.Remove(tmp.Name())
	_, err = io.Copy(tmp, resp.Body)
	if err == nil {
		if msg := resp.Trailer.Get("Cfguard-Backup-Error"); msg != "" {
			err = errors.New("the daemon reported: " + msg)
		}
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return ledger.Info{}, fmt.Errorf("backup: writing %s: %w", out, err)
	}
	info, err := ledger.Verify(tmp.Name())
	if ce := (*ledger.CorruptError)(nil); errors.As(err, &ce) {
		// Not the advice for a damaged ledger: the snapshot is removed, the daemon runs on.
		return ledger.Info{}, fmt.Errorf("backup: the snapshot received did not verify: %v. It was removed and nothing was written to %s; "+
			"run cfguard backup again, and if it fails again, the daemon's ledger may be damaged: see its log (cfguard run verifies every record at start)",
			ce.Detail, out)
	}
	if errors.Is(err, ledger.ErrNewerSchema) {
		return ledger.Info{}, fmt.Errorf("backup: the daemon's ledger is of a newer cfguard than this one (nothing was written to %s): "+
			"take the backup with the daemon's own cfguard: %w", out, err)
	}
	if err != nil {
		return ledger.Info{}, fmt.Errorf("backup: the downloaded snapshot failed verification (nothing was written to %s): %w", out, err)
	}
	if err := os.Link(tmp.Name(), out); err != nil {
		return ledger.Info{}, fmt.Errorf("backup: %w", err)
	}
	// The link is durable once its directory is: until then a crash could lose the backup
	// reported written.
	dir := filepath.Dir(out)
	if err := atomicfile.SyncDir(dir); err != nil {
		os.Remove(out)
		return ledger.Info{}, fmt.Errorf("backup: syncing the directory %s after linking %s failed, so the backup might not survive a "+
			"crash; %s was removed: run cfguard backup again (with --out in a directory that can be synced): %w", dir, out, out, err)
	}
	info.Path = out
	return info, nil
}

// cmdRestore installs a backup as the configuration's state_dir/cfguard.db. It refuses while a
// daemon holds the state directory and never replaces an existing ledger. The daemon started
// afterwards resumes from the backup's offsets: records after them are read again from the
// topic (they must still be within the broker's retention), and none before them is applied
// twice, since the offsets and the posterior were committed together.
func cmdRestore(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	flags := flag.NewFlagSet("restore", flag.ContinueOnError)
	path := flags.String("config", "config.yaml", "the daemon's configuration (state_dir)")
	from := flags.String("from", "", "a backup written by cfguard backup")
	if err := cli.ParseFlags(flags, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("from", *from); err != nil {
		return err
	}
	// Only state_dir is read: a restore runs where the model and key files need not be (a
	// one-off pod that mounts the state volume alone).
	cfg, err := config.LoadClientFile(*path)
	if err != nil {
		return err
	}
	info, err := ledger.RestoreWith(*from, cfg.StateDir, ledger.RestoreOptions{Repairing: func(detail string) {
		fmt.Fprintf(stderr, "cfguard restore: the backup %s does not verify (%s); repairing a copy of it in %s as a start of cfguard "+
			"would (about a second per million counterfactuals), then installing that\n", *from, detail, cfg.StateDir)
	}})
	if err != nil {
		return namingConfig(err, *path)
	}
	if info.Repaired != nil {
		reportRepaired(stderr, *from, info.Repaired)
	}
	return printJSON(stdout, info)
}

// maxRepairLines bounds the quarantined CEs reportRepaired names one per line; the JSON printed
// names them all.
const maxRepairLines = 100

// reportRepaired says on w what cfguard restore repaired in the backup from before installing it
// (ledger.Info.Repaired, printed in full under "repaired").
func reportRepaired(w io.Writer, from string, r *ledger.Repairs) {
	fmt.Fprintf(w, "cfguard restore: the backup %s has damaged records; the installed ledger holds what a start of cfguard makes of "+
		"them (all under \"repaired\" in the output):\n", from)
	for i, q := range r.Quarantined {
		if i == maxRepairLines {
			fmt.Fprintf(w, "  and %d more counterfactuals quarantined\n", len(r.Quarantined)-i)
			break
		}
		fmt.Fprintf(w, "  counterfactual %q quarantined: %s\n", q.ID, q.Reason)
	}
	if len(r.Quarantined) > 0 {
		fmt.Fprintf(w, "  a quarantined counterfactual answers 500 until it is deleted or registered again: register the %d again "+
			"with their id (POST /v1/counterfactuals) or delete them (DELETE /v1/counterfactuals/{id})\n", len(r.Quarantined))
	}
	for _, o := range []struct {
		n    int
		what string
	}{
		{r.IndexEntries, "damaged index entries; the indexes were rebuilt"},
		{r.QualityRecords, "damaged prequential records deleted; the scores go on from the records kept"},
		{r.ReissueEntries, "damaged reissue entries written again, their counterfactuals still waiting"},
		{r.AnchorKLHistories, "damaged anchor KL histories deleted; each starts again at the next update"},
		{r.AnchorKLStrays, "anchor KL records no anchor's history reaches deleted"},
		{len(r.KeptEvents), "damaged records of the last KL events deleted (meta " + strings.Join(r.KeptEvents, ", ") + ")"},
	} {
		if o.n > 0 {
			fmt.Fprintf(w, "  %d %s\n", o.n, o.what)
		}
	}
}

// daemonURL is the base URL of the daemon cfg configures: https:// when http.web_config_file
// serves TLS (and is readable here), else http://, to http.listen.
func daemonURL(cfg *config.Config) (string, error) {
	if _, port, err := net.SplitHostPort(cfg.HTTP.Listen); err == nil && port == "0" {
		return "", fmt.Errorf("%w: http.listen %q has port 0: the daemon picks its port at start, so no default URL can be made from it; "+
			"give --url with the address the daemon's log line \"HTTP API listening\" names", cli.ErrUsage, cfg.HTTP.Listen)
	}
	scheme := "http://"
	if cfg.ServesTLS() {
		scheme = "https://"
	}
	return scheme + dialAddr(cfg.HTTP.Listen), nil
}

// checkURL refuses a --url a client of the daemon's API could not ask ("" is the default).
func checkURL(u string) error {
	if u == "" {
		return nil
	}
	if p, err := neturl.Parse(u); err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
		return fmt.Errorf("%w: --url %q: want the daemon's base URL, http:// or https:// with its host and port (http://127.0.0.1:8080)", cli.ErrUsage, u)
	}
	return nil
}

// statusHint is what to do about an answer of the daemon's API with status code, in brackets
// after a space, or "": a 401 names the setting that gives the token.
func statusHint(code int) string {
	if code == http.StatusUnauthorized {
		return " (the daemon wants http.token: give --config the daemon's token, or set CFGUARD_HTTP_TOKEN)"
	}
	return ""
}

// dialAddr turns a listen address into one to dial: a wildcard host becomes 127.0.0.1.
func dialAddr(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return listen
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
