package command

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/cli"
)

// ImportSummary is what cfguard import-ces prints at the end.
type ImportSummary struct {
	Lines  int `json:"lines"` // non-blank lines read
	Stored int `json:"stored"`
	// Accepted: lines replicas sent to their owners, which store or refuse each.
	Accepted int     `json:"accepted"`
	Exists   int     `json:"exists"` // already stored with the same CE (a re-run)
	Refused  int     `json:"refused"`
	Seconds  float64 `json:"seconds"`
	Rate     float64 `json:"lines_per_second"`
}

// bulkBatch is lines sent in one POST /v1/counterfactuals:bulk, with their line numbers.
type bulkBatch struct {
	body  []byte
	lines []int
}

// cmdImportCEs loads counterfactuals from an NDJSON file (one POST /v1/counterfactuals request
// per line, each with its id) into a running daemon through POST /v1/counterfactuals:bulk, in
// batches. A bad line is refused with its line number and the import goes on; the command exits
// 1 at the end if any line was refused. Running it again stores nothing twice: lines already
// stored are counted as existing.
func cmdImportCEs(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("import-ces", flag.ContinueOnError)
	path := fs.String("config", "config.yaml", "the running daemon's configuration (http.listen, http.token, http.max_body_bytes)")
	from := fs.String("from", "", "NDJSON file: one {\"id\", \"x\", \"x_cf\", \"target\"} per line")
	url := fs.String("url", "", "the daemon's base URL (default: http://<http.listen>, https:// when http.web_config_file serves TLS; a wildcard host read as 127.0.0.1)")
	batch := fs.Int("batch", 1000, "lines per request (also bounded by http.max_body_bytes)")
	parallel := fs.Int("parallel", 2, "requests in flight")
	every := fs.Duration("progress", 5*time.Second, "progress line interval on stderr")
	tlsFlags := addAPITLSFlags(fs)
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("from", *from); err != nil {
		return err
	}
	if *batch < 1 || *batch > 10000 || *parallel < 1 || *every <= 0 {
		return fmt.Errorf("%w: --batch must be 1..10000, --parallel at least 1, --progress positive", cli.ErrUsage)
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
	// A batch's body stays under http.max_body_bytes with room for the line separators.
	maxBody := int(cfg.HTTP.MaxBodyBytes)
	total, err := countLines(*from, maxBody)
	if err != nil {
		return err
	}
	f, err := os.Open(*from)
	if err != nil {
		return err
	}
	defer f.Close()
	imp := &importer{url: strings.TrimSuffix(*url, "/") + "/v1/counterfactuals:bulk", token: cfg.HTTP.Token,
		stderr: stderr, client: client, total: total, start: time.Now()}
	batches := make(chan bulkBatch, *parallel)
	sendCtx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	var sendErr error
	var errOnce sync.Once
	for range *parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range batches {
				if err := imp.send(sendCtx, b); err != nil {
					errOnce.Do(func() { sendErr = err; stop() })
					return
				}
			}
		}()
	}
	ticker := time.NewTicker(*every)
	defer ticker.Stop()
	readErr := readBatches(sendCtx, f, *batch, maxBody, imp, batches, ticker.C)
	close(batches)
	wg.Wait()
	if sendErr == nil && readErr != nil {
		sendErr = readErr
	}
	sum := imp.summary()
	imp.progress()
	if err := printJSON(stdout, sum); err != nil {
		return err
	}
	if sendErr != nil {
		return fmt.Errorf("stopped after %d of %d lines were answered: %w; once its cause is fixed, run the same command again: stored lines are counted as existing, not stored twice", imp.answered(), total, sendErr)
	}
	if sum.Accepted > 0 {
		fmt.Fprintf(stderr, "import-ces: %d lines were accepted by replicas and sent to their CEs' owners, which store or refuse each "+
			"(an id stored with another CE is refused there): GET /v1/counterfactuals/{id} tells which\n", sum.Accepted)
	}
	if sum.Refused > 0 {
		return fmt.Errorf("%d of %d lines refused (each named above with its line number); %s. Fix those lines and run the same command again: stored lines are counted as existing, not stored twice", sum.Refused, sum.Lines, othersSaid(sum))
	}
	return nil
}

// othersSaid says what became of the lines not refused, from the summary's counts.
func othersSaid(sum ImportSummary) string {
	parts := []string{fmt.Sprintf("%d stored", sum.Stored), fmt.Sprintf("%d existing (stored already)", sum.Exists)}
	if sum.Accepted > 0 {
		parts = append(parts, fmt.Sprintf("%d accepted by replicas", sum.Accepted))
	}
	return "of the others, " + strings.Join(parts, ", ")
}

// readBatches reads the file's lines into batches of up to size lines and maxBody bytes,
// refusing here the lines the daemon could not be sent: a line over maxBody (read past, not
// kept), bad JSON, no id, an id given on an earlier line. It prints progress on each tick.
func readBatches(ctx context.Context, r io.Reader, size, maxBody int, imp *importer, out chan<- bulkBatch, tick <-chan time.Time) error {
	seen := map[string]int{} // id -> line
	var b bulkBatch
	flush := func() error {
		if len(b.lines) == 0 {
			return nil
		}
		select {
		case out <- b:
		case <-ctx.Done():
			return ctx.Err()
		}
		b = bulkBatch{}
		return nil
	}
	err := eachLine(r, maxBody, func(n int, line []byte, length int) error {
		select {
		case <-tick:
			imp.progress()
		default:
		}
		if blank(line) {
			return nil
		}
		line = bytes.TrimSpace(line) // nil (over the limit) stays nil
		imp.read()
		if line == nil || len(line)+1 > maxBody {
			imp.refuse(n, fmt.Sprintf("%d bytes, over http.max_body_bytes %d", length, maxBody))
			return nil
		}
		var head struct {
			ID *string `json:"id"`
		}
		var typeErr *json.UnmarshalTypeError
		switch err := json.Unmarshal(line, &head); {
		case errors.As(err, &typeErr) && typeErr.Field == "id":
			imp.refuse(n, fmt.Sprintf("bad JSON: id is a JSON %s, want a string", typeErr.Value))
			return nil
		case errors.As(err, &typeErr):
			imp.refuse(n, fmt.Sprintf(`bad JSON: the line is a JSON %s, want an object {"id", "x", "x_cf", "target"}`, typeErr.Value))
			return nil
		case err != nil:
			imp.refuse(n, "bad JSON: "+err.Error())
			return nil
		case head.ID == nil || *head.ID == "":
			imp.refuse(n, "no id: an import needs each CE's id, so that running it again stores nothing twice")
			return nil
		}
		if first, ok := seen[*head.ID]; ok {
			imp.refuse(n, fmt.Sprintf("id %q repeats line %d", *head.ID, first))
			return nil
		}
		seen[*head.ID] = n
		if len(b.lines) == size || len(b.body)+len(line)+1 > maxBody {
			if err := flush(); err != nil {
				return err
			}
		}
		b.body = append(append(b.body, line...), '\n')
		b.lines = append(b.lines, n)
		return nil
	})
	if err != nil {
		return err
	}
	return flush()
}

// eachLine calls fn with each line of r, numbered from 1, without its newline. A line longer
// than limit bytes is read past without being kept: fn gets it as nil with its length.
func eachLine(r io.Reader, limit int, fn func(n int, line []byte, length int) error) error {
	br := bufio.NewReaderSize(r, 1<<16)
	var line []byte // reused: fn copies what it keeps
	for n := 1; ; n++ {
		line = line[:0]
		length := 0
		var err error
		for {
			var chunk []byte
			chunk, err = br.ReadSlice('\n')
			length += len(chunk)
			if length <= limit+1 { // the line and its newline
				line = append(line, chunk...)
			}
			if err != bufio.ErrBufferFull {
				break
			}
		}
		if err != nil && err != io.EOF {
			return err
		}
		if err == io.EOF && length == 0 {
			return nil
		}
		if bytes.HasSuffix(line, []byte{'\n'}) {
			line, length = line[:len(line)-1], length-1
		} else if length > 0 && err == nil {
			length-- // a long line's newline, not kept
		}
		kept := line
		if length > limit {
			kept = nil
		}
		if ferr := fn(n, kept, length); ferr != nil {
			return ferr
		}
		if err == io.EOF {
			return nil
		}
	}
}

// importer sends batches and keeps the counts.
type importer struct {
	url, token string
	stderr     io.Writer
	client     *http.Client
	total      int
	start      time.Time

	mu                                             sync.Mutex
	lines, stored, accepted, exists, refused, done int // done: lines answered or refused

	sayMu sync.Mutex // the reader and the senders write lines to stderr: one at a time
}

// say writes one line to stderr. The reader and the senders call it at once; a writer such as
// a strings.Builder is not safe for concurrent use, and even a file would interleave lines.
func (imp *importer) say(format string, args ...any) {
	imp.sayMu.Lock()
	defer imp.sayMu.Unlock()
	fmt.Fprintf(imp.stderr, format, args...)
}

func (imp *importer) read() {
	imp.mu.Lock()
	imp.lines++
	imp.mu.Unlock()
}

// refuse reports a refused line on stderr.
func (imp *importer) refuse(line int, why string) {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	imp.refused++
	imp.done++
	imp.say("import-ces: line %d refused: %s\n", line, why)
}

func (imp *importer) summary() ImportSummary {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	s := ImportSummary{Lines: imp.lines, Stored: imp.stored, Accepted: imp.accepted, Exists: imp.exists, Refused: imp.refused,
		Seconds: time.Since(imp.start).Seconds()}
	s.Rate = float64(imp.done) / s.Seconds
	return s
}

// answered is how many lines were answered or refused so far.
func (imp *importer) answered() int {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	return imp.done
}

// progress prints done/total, the counts and the rate on stderr.
func (imp *importer) progress() {
	s := imp.summary()
	done := imp.answered()
	left := ""
	if s.Rate > 0 && done < imp.total {
		left = fmt.Sprintf(", about %v left", (time.Duration(float64(imp.total-done)/s.Rate) * time.Second).Round(time.Second))
	}
	accepted := ""
	if s.Accepted > 0 {
		accepted = fmt.Sprintf(", %d accepted by replicas", s.Accepted)
	}
	imp.say("import-ces: %d/%d lines (%.1f%%), %d stored%s, %d existing, %d refused, %.0f lines/s%s\n",
		done, imp.total, 100*float64(done)/float64(max(imp.total, 1)), s.Stored, accepted, s.Exists, s.Refused, s.Rate, left)
}

// maxRetries bounds the retries of one batch answered 503 or 429 (the daemon's Retry-After
// between them).
const maxRetries = 30

// send posts one batch, retrying while the daemon answers 503 or 429, and records each line's
// outcome.
func (imp *importer) send(ctx context.Context, b bulkBatch) error {
	for attempt := 0; ; attempt++ {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, imp.url, bytes.NewReader(b.body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/x-ndjson")
		if imp.token != "" {
			req.Header.Set("Authorization", "Bearer "+imp.token)
		}
		resp, err := imp.client.Do(req)
		if err != nil {
			hint := tlsHint(err)
			if hint == "" {
				hint = "is the daemon running?"
			}
			return fmt.Errorf("lines %d-%d: %w (%s)", b.lines[0], b.lines[len(b.lines)-1], err, hint)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return fmt.Errorf("lines %d-%d: reading the answer: %w", b.lines[0], b.lines[len(b.lines)-1], err)
		}
		if (resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests) && attempt < maxRetries {
			wait := time.Second
			if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
				wait = time.Duration(s) * time.Second
			}
			imp.say("import-ces: lines %d-%d: %s, retrying in %v: %s\n", b.lines[0], b.lines[len(b.lines)-1], resp.Status, wait, strings.TrimSpace(string(body)))
			select {
			case <-time.After(wait):
				continue
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("lines %d-%d: POST %s: %s: %s%s", b.lines[0], b.lines[len(b.lines)-1], imp.url, resp.Status, strings.TrimSpace(string(body)), statusHint(resp.StatusCode))
		}
		return imp.record(b, body)
	}
}

// record counts the outcome of each line of an answered batch and reports the refused ones.
func (imp *importer) record(b bulkBatch, body []byte) error {
	var resp struct {
		Results []struct {
			Line   int    `json:"line"`
			Status string `json:"status"`
			Code   int    `json:"code"`
			Error  string `json:"error"`
		} `json:"results"`
	}
	if err := json.Unmarshal(body, &resp); err != nil || len(resp.Results) != len(b.lines) {
		return fmt.Errorf("lines %d-%d: the daemon's answer does not hold one result per line (%d for %d lines): %v", b.lines[0], b.lines[len(b.lines)-1], len(resp.Results), len(b.lines), err)
	}
	for k, r := range resp.Results {
		switch {
		case r.Code != 0:
			imp.refuse(b.lines[k], fmt.Sprintf("%d: %s", r.Code, r.Error))
		case r.Status == "exists":
			imp.count(&imp.exists)
		case r.Status == "accepted":
			imp.count(&imp.accepted)
		default:
			imp.count(&imp.stored)
		}
	}
	return nil
}

func (imp *importer) count(n *int) {
	imp.mu.Lock()
	*n++
	imp.done++
	imp.mu.Unlock()
}

// countLines counts the lines of a file that readBatches reads (eachLine with limit, blank
// lines skipped), for the progress lines' total.
func countLines(path string, limit int) (int, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("--from: %w", err)
	}
	defer f.Close()
	n := 0
	err = eachLine(f, limit, func(_ int, line []byte, _ int) error {
		if !blank(line) {
			n++
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("--from %s: %w", path, err)
	}
	return n, nil
}

// blank reports whether line, as eachLine gives it, holds only white space (bytes.TrimSpace's:
// ASCII and Unicode). A line over the limit (nil) is not blank: it is read, and refused.
func blank(line []byte) bool { return line != nil && len(bytes.TrimSpace(line)) == 0 }
