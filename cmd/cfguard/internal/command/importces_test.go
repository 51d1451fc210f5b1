package command

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/cli"
)

// TestReadBatchesRefusesLongLinesAndGoesOn: a line over http.max_body_bytes is refused by its
// number and read past, whatever its length against the reader's buffer, and the lines after it
// are sent; blank lines are skipped, CRLF endings and a last line without a newline are read.
func TestReadBatchesRefusesLongLinesAndGoesOn(t *testing.T) {
	for _, maxBody := range []int{300, 70_000, 1 << 20} {
		t.Run(fmt.Sprint(maxBody), func(t *testing.T) {
			long := `{"id": "long", "x": [` + strings.Repeat("1,", maxBody) + `1]}`
			edge := `{"id": "edge", "pad": "` + strings.Repeat("a", maxBody-26) + `"}` // maxBody-1 bytes: fits with its newline
			over := `{"id": "over", "pad": "` + strings.Repeat("a", maxBody-25) + `"}` // maxBody bytes: does not
			if len(edge) != maxBody-1 || len(over) != maxBody {
				t.Fatalf("lines of %d and %d bytes, want %d and %d", len(edge), len(over), maxBody-1, maxBody)
			}
			lines := []string{`{"id": "a"}`, long, "", `{"id": "b"}` + "\r", edge, over, `{"id": "c"}`}
			var stderr strings.Builder
			imp := &importer{stderr: &stderr, start: time.Now()}
			out := make(chan bulkBatch, 10)
			err := readBatches(context.Background(), strings.NewReader(strings.Join(lines, "\n")), 2, maxBody, imp, out, nil)
			close(out)
			if err != nil {
				t.Fatalf("readBatches: %v", err)
			}
			var sent []int
			for b := range out {
				if len(b.body) > maxBody {
					t.Errorf("a batch of %d bytes, over %d", len(b.body), maxBody)
				}
				sent = append(sent, b.lines...)
			}
			if want := []int{1, 4, 5, 7}; !slices.Equal(sent, want) {
				t.Errorf("lines sent %v, want %v; stderr:\n%s", sent, want, stderr.String())
			}
			for _, want := range []string{
				fmt.Sprintf("line 2 refused: %d bytes, over http.max_body_bytes %d", len(long), maxBody),
				fmt.Sprintf("line 6 refused: %d bytes, over http.max_body_bytes %d", len(over), maxBody),
			} {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
				}
			}
			if s := imp.summary(); s.Lines != 6 || s.Refused != 2 {
				t.Errorf("summary %+v, want 6 lines read, 2 refused", s)
			}
		})
	}
}

// A line a replica sent to its CE's owner is counted accepted, neither stored nor existing:
// the owner stores or refuses it after the answer.
func TestImportCountsLinesAcceptedByReplicas(t *testing.T) {
	var stderr strings.Builder
	imp := &importer{stderr: &stderr, total: 4, start: time.Now()}
	body := `{"stored":1,"accepted":2,"exists":1,"refused":0,"results":[` +
		`{"line":1,"id":"a","status":"certified"},{"line":2,"id":"b","status":"accepted"},` +
		`{"line":3,"id":"c","status":"accepted"},{"line":4,"id":"d","status":"exists"}]}`
	if err := imp.record(bulkBatch{lines: []int{1, 2, 3, 4}}, []byte(body)); err != nil {
		t.Fatal(err)
	}
	if s := imp.summary(); s.Stored != 1 || s.Accepted != 2 || s.Exists != 1 || s.Refused != 0 {
		t.Errorf("summary %+v, want 1 stored, 2 accepted, 1 existing", s)
	}
	imp.progress()
	if !strings.Contains(stderr.String(), "1 stored, 2 accepted by replicas, 1 existing") {
		t.Errorf("progress line %q does not count the accepted lines", stderr.String())
	}
}

// fakeBulk is an HTTP server that answers POST /v1/counterfactuals:bulk as the daemon does: one
// "certified" result per non-blank line. It records each request's path, Authorization header and
// line count; busy answers that many requests 429 with Retry-After: 2 first, and fail, when set,
// answers every request instead.
type fakeBulk struct {
	mu    sync.Mutex
	paths []string
	auths []string
	sizes []int
	busy  int
	fail  func(w http.ResponseWriter, lines int)
}

func (f *fakeBulk) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	n := 0
	for line := range strings.Lines(string(body)) {
		if strings.TrimSpace(line) != "" {
			n++
		}
	}
	f.mu.Lock()
	f.paths, f.auths = append(f.paths, r.Method+" "+r.URL.Path), append(f.auths, r.Header.Get("Authorization"))
	busy := f.busy > 0
	if busy {
		f.busy--
	} else {
		f.sizes = append(f.sizes, n)
	}
	fail := f.fail
	f.mu.Unlock()
	switch {
	case busy:
		w.Header().Set("Retry-After", "2")
		http.Error(w, "busy", http.StatusTooManyRequests)
	case fail != nil:
		fail(w, n)
	default:
		results := make([]map[string]any, n)
		for k := range results {
			results[k] = map[string]any{"line": k + 1, "status": "certified"}
		}
		json.NewEncoder(w).Encode(map[string]any{"stored": n, "results": results})
	}
}

// lines returns how many lines the server was sent in answered requests, and the most in one.
func (f *fakeBulk) lines() (total, most int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, n := range f.sizes {
		total, most = total+n, max(most, n)
	}
	return total, most
}

// importSetup starts a fakeBulk and writes a configuration whose http.listen is its address and
// whose http.token is "tok".
func importSetup(t *testing.T) (*fakeBulk, *httptest.Server, string) {
	t.Helper()
	f := &fakeBulk{}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(cfg, []byte("http:\n  listen: "+srv.Listener.Addr().String()+"\n  token: tok\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return f, srv, cfg
}

// ceFile writes n lines with the ids ce-0 .. ce-n-1, then the extra lines, and returns its path.
func ceFile(t *testing.T, n int, extra ...string) string {
	t.Helper()
	var b strings.Builder
	for k := range n {
		fmt.Fprintf(&b, `{"id": "ce-%d", "x": [1], "x_cf": [2], "target": 1}`+"\n", k)
	}
	for _, l := range extra {
		b.WriteString(l + "\n")
	}
	p := filepath.Join(t.TempDir(), "ces.ndjson")
	if err := os.WriteFile(p, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// Without --url, import-ces posts to http.listen of its configuration, with http.token, in
// batches of at most --batch lines (1000 when not given); a URL given with a trailing slash
// names the same endpoint. A batch answered 429 is sent again after the daemon's Retry-After.
// A line whose id is empty is refused before sending: the id is what makes a re-run store
// nothing twice.
func TestImportCEsPostsToTheConfiguredDaemon(t *testing.T) {
	for _, tc := range []struct {
		name      string
		n         int
		extra     []string
		args      []string
		busy      int
		wantErr   string
		wantStd   []string
		wantBatch int
	}{
		{name: "config address, token, batch and a 429", n: 5, extra: []string{`{"id": "", "x": [1], "x_cf": [2], "target": 1}`},
			args: []string{"--batch", "2"}, busy: 1, wantErr: "1 of 6 lines refused",
			wantStd: []string{"line 6 refused: no id", "429 Too Many Requests, retrying in 2s"}, wantBatch: 2},
		{name: "default batch", n: 1001, wantBatch: 1000},
		{name: "trailing slash", n: 3, args: []string{"--url", "/"}, wantBatch: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, srv, cfg := importSetup(t)
			f.busy = tc.busy
			args := []string{"--config", cfg, "--from", ceFile(t, tc.n, tc.extra...), "--progress", "1h"}
			for i := 0; i < len(tc.args); i += 2 {
				if tc.args[i] == "--url" {
					tc.args[i+1] = srv.URL + tc.args[i+1]
				}
			}
			var stdout, stderr strings.Builder
			err := cmdImportCEs(context.Background(), append(args, tc.args...), &stdout, &stderr)
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("import-ces: %v, want an error naming %q; stderr:\n%s", err, tc.wantErr, stderr.String())
			}
			for _, want := range tc.wantStd {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
				}
			}
			var sum ImportSummary
			if err := json.Unmarshal([]byte(stdout.String()), &sum); err != nil || sum.Stored != tc.n {
				t.Errorf("summary %q (%v), want %d stored", stdout.String(), err, tc.n)
			}
			if total, most := f.lines(); total != tc.n || most != tc.wantBatch {
				t.Errorf("the daemon was sent %d lines, at most %d in a request; want %d, at most %d", total, most, tc.n, tc.wantBatch)
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			for k := range f.paths {
				if f.paths[k] != "POST /v1/counterfactuals:bulk" || f.auths[k] != "Bearer tok" {
					t.Errorf("request %d: %s with Authorization %q, want POST /v1/counterfactuals:bulk with Bearer tok", k, f.paths[k], f.auths[k])
				}
			}
		})
	}
}

// An answer import-ces cannot count lines by stops the import at once with an error naming it:
// a status other than 200 by its status and body, a 200 without one result per line as such.
func TestImportCEsStopsOnAnAnswerItCannotCount(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(w http.ResponseWriter, lines int)
		want string
	}{
		{"500", func(w http.ResponseWriter, _ int) {
			http.Error(w, "the ledger is gone", http.StatusInternalServerError)
		},
			"500 Internal Server Error: the ledger is gone"},
		{"a result short", func(w http.ResponseWriter, lines int) {
			json.NewEncoder(w).Encode(map[string]any{"results": make([]map[string]any, lines-1)})
		}, "does not hold one result per line (1 for 2 lines)"},
		{"401", func(w http.ResponseWriter, _ int) {
			http.Error(w, `{"error":"missing or invalid bearer token"}`, http.StatusUnauthorized)
		}, "401 Unauthorized: {\"error\":\"missing or invalid bearer token\"} (the daemon wants http.token: give --config the daemon's token, or set CFGUARD_HTTP_TOKEN)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, _, cfg := importSetup(t)
			f.fail = tc.fail
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			var stdout, stderr strings.Builder
			err := cmdImportCEs(ctx, []string{"--config", cfg, "--from", ceFile(t, 20), "--batch", "2", "--parallel", "1", "--progress", "1h"}, &stdout, &stderr)
			if ctx.Err() != nil {
				t.Fatalf("import-ces ran until the test's deadline: %v", err)
			}
			// The first request failed, and none other was sent (--parallel 1): no line was answered,
			// however many were read.
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "stopped after 0 of 20 lines were answered") {
				t.Fatalf("import-ces: %v, want it stopped after 0 of 20 lines were answered, naming %q", err, tc.want)
			}
		})
	}
}

// A cancelled import (SIGINT) ends with an error, never as an import that read the whole file.
func TestImportCEsCancelledIsAnError(t *testing.T) {
	_, _, cfg := importSetup(t)
	file := ceFile(t, 50)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	// Where the cancel is seen depends on scheduling (a send, or the reader handing a batch over):
	// each run must end in an error.
	for range 20 {
		var stdout, stderr strings.Builder
		if err := cmdImportCEs(ctx, []string{"--config", cfg, "--from", file, "--batch", "5", "--progress", "1h"}, &stdout, &stderr); err == nil {
			t.Fatalf("a cancelled import-ces returned no error; stdout %s", stdout.String())
		}
	}
}

// --batch outside 1..10000, --parallel below 1 and a --progress that is not positive are usage
// errors (exit 2), refused before anything is sent.
func TestImportCEsFlagRanges(t *testing.T) {
	f, _, cfg := importSetup(t)
	file := ceFile(t, 3)
	for _, bad := range [][]string{{"--batch", "0"}, {"--batch", "10001"}, {"--parallel", "0"}, {"--progress", "0s"}} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var stdout, stderr strings.Builder
		code := Run(ctx, append([]string{"import-ces", "--config", cfg, "--from", file}, bad...), &stdout, &stderr)
		cancel()
		if code != 2 || !strings.Contains(stderr.String(), "--batch must be 1..10000") {
			t.Errorf("import-ces %v: exit %d, stderr %q; want 2 naming the ranges", bad, code, stderr.String())
		}
	}
	if total, _ := f.lines(); total != 0 {
		t.Errorf("refused imports sent %d lines", total)
	}
}

// A batch is bounded in bytes with its newlines: two lines of L bytes do not share a batch of
// at most 2L+1 bytes.
func TestReadBatchesCountsTheNewlines(t *testing.T) {
	const line = `{"id": "a%d"}`
	l := len(fmt.Sprintf(line, 0))
	var in strings.Builder
	for k := range 5 {
		fmt.Fprintf(&in, line+"\n", k)
	}
	var stderr strings.Builder
	imp := &importer{stderr: &stderr, start: time.Now()}
	out := make(chan bulkBatch, 10)
	if err := readBatches(context.Background(), strings.NewReader(in.String()), 10, 2*l+1, imp, out, nil); err != nil {
		t.Fatal(err)
	}
	close(out)
	for b := range out {
		if len(b.body) > 2*l+1 || len(b.lines) != 1 {
			t.Errorf("a batch of %d bytes holding lines %v; want one line, at most %d bytes", len(b.body), b.lines, 2*l+1)
		}
	}
}

// The total the progress lines count toward is the number of lines the import reads: blank
// lines (ASCII or Unicode white space only) are not counted; a last line without a newline is,
// and so is a line over the limit, even of spaces (it is read, and refused).
func TestCountLinesMatchesTheLinesRead(t *testing.T) {
	const limit = 64
	text := "{\"id\": \"a\"}\r\n \t\r\n\n{\"id\": \"b\"}\n   \n\v\f\n\u00a0\u3000\n" + strings.Repeat(" ", 2*limit) + "\n{\"id\": \"c\"}"
	p := filepath.Join(t.TempDir(), "ces.ndjson")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	n, err := countLines(p, limit)
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	imp := &importer{stderr: &stderr, start: time.Now()}
	out := make(chan bulkBatch, 10)
	if err := readBatches(context.Background(), strings.NewReader(text), 10, limit, imp, out, nil); err != nil {
		t.Fatal(err)
	}
	if s := imp.summary(); n != 4 || s.Lines != 4 {
		t.Errorf("countLines %d, lines read %d; want 4 and 4", n, s.Lines)
	}
}

// The address import-ces and backup dial when --url is not given is http.listen's, a wildcard
// host read as 127.0.0.1.
// backup and import-ces refuse a --url they could not ask as a usage error naming the flag, not
// as a daemon that does not answer; import-ces names --from when the file cannot be opened.
func TestClientsNameTheFlagsTheyCannotUse(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	lines := filepath.Join(dir, "ces.ndjson")
	for _, p := range []string{cfg, lines} {
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, u := range []string{"notaurl", "127.0.0.1:8080", "ftp://127.0.0.1:8080", "http://"} {
		for _, args := range [][]string{
			{"backup", "--config", cfg, "--out", filepath.Join(dir, "b.db"), "--url", u},
			{"import-ces", "--config", cfg, "--from", lines, "--url", u},
		} {
			var out, errs strings.Builder
			if code := Run(context.Background(), args, &out, &errs); code != cli.ExitUsage || !strings.Contains(errs.String(), "--url "+strconv.Quote(u)) {
				t.Errorf("%v: exit %d, %s; want %d naming --url", args, code, errs.String(), cli.ExitUsage)
			}
		}
	}
	var out, errs strings.Builder
	missing := filepath.Join(dir, "missing.ndjson")
	if code := Run(context.Background(), []string{"import-ces", "--config", cfg, "--from", missing}, &out, &errs); code != cli.ExitError ||
		!strings.Contains(errs.String(), "--from: open "+missing) {
		t.Errorf("a missing --from: exit %d, %s", code, errs.String())
	}
}

// A run with refused lines says what became of the others by its counts: lines stored
// already are existing, not stored.
func TestImportCEsRefusedSaysWhatTheOthersAre(t *testing.T) {
	f, _, cfg := importSetup(t)
	f.fail = func(w http.ResponseWriter, n int) {
		results := make([]map[string]any, n)
		for k := range results {
			results[k] = map[string]any{"line": k + 1, "status": "exists"}
		}
		json.NewEncoder(w).Encode(map[string]any{"exists": n, "results": results})
	}
	from := ceFile(t, 3, `{"id": "", "x": [1], "x_cf": [2], "target": 1}`)
	var stdout, stderr strings.Builder
	err := cmdImportCEs(context.Background(), []string{"--config", cfg, "--from", from, "--progress", "1h"}, &stdout, &stderr)
	if want := "1 of 4 lines refused (each named above with its line number); of the others, 0 stored, 3 existing (stored already)."; err == nil ||
		!strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "the others are stored") {
		t.Errorf("import-ces of lines stored already and one refused: %v; want %q", err, want)
	}
}

// http.listen with port 0 makes no default URL: backup and import-ces say so and ask for --url,
// rather than dial port 0 and ask whether the daemon runs.
func TestPortZeroListenWantsURL(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("http:\n  listen: 127.0.0.1:0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	from := ceFile(t, 1)
	for _, args := range [][]string{
		{"backup", "--config", cfg, "--out", filepath.Join(dir, "b.db")},
		{"import-ces", "--config", cfg, "--from", from},
	} {
		var out, errs strings.Builder
		code := Run(context.Background(), args, &out, &errs)
		if code != cli.ExitUsage || !strings.Contains(errs.String(), `http.listen "127.0.0.1:0" has port 0`) || !strings.Contains(errs.String(), "give --url") {
			t.Errorf("%s with http.listen 127.0.0.1:0: exit %d, %s", args[0], code, errs.String())
		}
	}
}

func TestDialAddr(t *testing.T) {
	for listen, want := range map[string]string{
		"0.0.0.0:8080":   "127.0.0.1:8080",
		":8080":          "127.0.0.1:8080",
		"[::]:8080":      "127.0.0.1:8080",
		"127.0.0.2:8080": "127.0.0.2:8080",
		"[::1]:8080":     "[::1]:8080",
		"localhost:8080": "localhost:8080",
	} {
		if got := dialAddr(listen); got != want {
			t.Errorf("dialAddr(%q) = %q, want %q", listen, got, want)
		}
	}
}

// backup and import-ces are clients of the daemon's API, restore reads state_dir: they run where the files its
// configuration names (model.path, replication.key_file, TLS files) do not exist, such as an
// operator's machine with the daemon's configuration file (docs/DEPLOY.md, "Backups").
func TestClientsDoNotNeedTheFilesTheConfigurationNames(t *testing.T) {
	f, srv, _ := importSetup(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	text := "http:\n  listen: " + srv.Listener.Addr().String() + "\n  token: tok\nmodel:\n  path: " + filepath.Join(dir, "absent-model") + "\n"
	if err := os.WriteFile(cfg, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr strings.Builder
	if err := cmdImportCEs(context.Background(), []string{"--config", cfg, "--from", ceFile(t, 2), "--progress", "1h"}, &stdout, &stderr); err != nil {
		t.Fatalf("import-ces with a configuration whose model.path is not on this machine: %v", err)
	}
	if total, _ := f.lines(); total != 2 {
		t.Errorf("the daemon was sent %d lines, want 2", total)
	}
	err := cmdBackup(context.Background(), []string{"--config", cfg, "--out", filepath.Join(dir, "b.db")}, &stdout, &stderr)
	if err == nil || strings.Contains(err.Error(), "model.path") || !strings.Contains(err.Error(), "snapshot received did not verify") {
		t.Fatalf("backup: %v, want the fake daemon's answer refused as a snapshot, not model.path", err)
	}
	// restore reads state_dir alone.
	garbage := filepath.Join(dir, "garbage.db")
	if err := os.WriteFile(garbage, []byte("not a ledger"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = cmdRestore(context.Background(), []string{"--config", cfg, "--from", garbage}, &stdout, &stderr)
	if err == nil || strings.Contains(err.Error(), "model.path") || !strings.Contains(err.Error(), garbage) {
		t.Fatalf("restore: %v, want the backup %s refused, not model.path", err, garbage)
	}
}

// A backup the daemon refuses for its token says which setting gives it, as import-ces does.
func TestBackupUnauthorizedNamesTheToken(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":"missing or wrong bearer token"}`, http.StatusUnauthorized)
	}))
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("http:\n  listen: "+srv.Listener.Addr().String()+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr strings.Builder
	err := cmdBackup(context.Background(), []string{"--config", cfg, "--out", filepath.Join(dir, "b.db")}, &stdout, &stderr)
	if err == nil || !strings.Contains(err.Error(), "401") || !strings.Contains(err.Error(), "http.token") || !strings.Contains(err.Error(), "CFGUARD_HTTP_TOKEN") {
		t.Fatalf("backup refused with 401: %v, want an error naming http.token and CFGUARD_HTTP_TOKEN", err)
	}
}

// A daemon whose http.web_config_file serves TLS is asked over https:// by default, and a
// certificate not trusted here is refused with how to trust it.
func TestClientsAskATLSDaemonOverHTTPS(t *testing.T) {
	f := &fakeBulk{}
	srv := httptest.NewTLSServer(f)
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	web := filepath.Join(dir, "web.yml")
	if err := os.WriteFile(web, []byte("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("http:\n  listen: "+srv.Listener.Addr().String()+"\n  web_config_file: "+web+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr strings.Builder
	err := cmdImportCEs(context.Background(), []string{"--config", cfg, "--from", ceFile(t, 1), "--progress", "1h"}, &stdout, &stderr)
	if err == nil || !strings.Contains(err.Error(), "https://"+srv.Listener.Addr().String()) || !strings.Contains(err.Error(), "SSL_CERT_FILE") {
		t.Errorf("import-ces to a TLS daemon whose CA is not trusted: %v, want an https:// request refused naming SSL_CERT_FILE", err)
	}
	err = cmdBackup(context.Background(), []string{"--config", cfg, "--out", filepath.Join(dir, "b.db")}, &stdout, &stderr)
	if err == nil || !strings.Contains(err.Error(), "https://"+srv.Listener.Addr().String()) || !strings.Contains(err.Error(), "SSL_CERT_FILE") {
		t.Errorf("backup of a TLS daemon whose CA is not trusted: %v, want an https:// request refused naming SSL_CERT_FILE", err)
	}
}

// A line of another JSON type than an object, or with an id that is no string, is refused
// saying so, not with the Go type import-ces decodes into.
func TestImportCEsRefusesLinesOfAnotherJSONType(t *testing.T) {
	_, _, cfg := importSetup(t)
	var stdout, stderr strings.Builder
	from := ceFile(t, 0, `[1, 2]`, `{"id": 5, "x": [1], "x_cf": [2], "target": 1}`)
	if err := cmdImportCEs(context.Background(), []string{"--config", cfg, "--from", from, "--progress", "1h"}, &stdout, &stderr); err == nil {
		t.Fatal("import-ces of two bad lines: no error")
	}
	for _, want := range []string{"line 1 refused: bad JSON: the line is a JSON array, want an object", "line 2 refused: bad JSON: id is a JSON number, want a string"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
		}
	}
	if strings.Contains(stderr.String(), "Go ") {
		t.Errorf("stderr names Go types:\n%s", stderr.String())
	}
}
