package writefail

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

const fsizeChildEnv = "CFGUARD_DAEMON_FSIZE_CHILD"

// fsizeChild begins a child process that runFsizeChild runs with fsizeChildEnv = value (the
// test skips in any other process): a full disk is made real with RLIMIT_FSIZE (the kernel
// refuses writes past the limit with EFBIG; SIGXFSZ is ignored), which works as non-root in CI;
// mounting a small tmpfs needs root. The limit applies to the whole process, so the broker here
// keeps its log in memory (an external broker for the daemon) and only the daemon's files are on
// disk. It returns the daemon, its broker and the limit before the test lowers it.
func fsizeChild(t *testing.T, value, parent string, opts func(o *daemon.Options)) (*launch.Running, *broker.Broker, syscall.Rlimit) {
	t.Helper()
	if os.Getenv(fsizeChildEnv) != value {
		t.Skip("child process of " + parent)
	}
	signal.Ignore(syscall.SIGXFSZ)
	var orig syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &orig); err != nil {
		t.Fatal(err)
	}
	b := daemontest.StartCluster(t, 1)
	r := launch.With(t, func(c *config.Config) { c.Kafka.Brokers = b.Addrs() }, opts, nil)
	waitfor.Cond(t, 20*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
	return r, b, orig
}

// TestCheckpointFailureChild is the child process of TestCheckpointFailureHoldsTheIncrement
// (fsizeChild).
func TestCheckpointFailureChild(t *testing.T) {
	// Its failed attempts are failed commits, which /readyz reports for ledgerFailureHold after
	// the last: a second here, so that the test sees it ready soon after the recovery.
	r, b, orig := fsizeChild(t, "1", "TestCheckpointFailureHoldsTheIncrement", func(o *daemon.Options) { o.Hooks.LedgerFailureHold = time.Second })
	data := daemontest.Bundled(t)
	sent := 0
	produce := func(n int) { // n good records (whole increments of 32)
		var vals [][]byte
		for i := 0; i < n; i++ {
			vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", sent), data.X[sent%len(data.X)], data.Y[sent%len(data.Y)]))
			sent++
		}
		r.Produce(t, vals...)
	}
	applied := func() int64 {
		st, err := r.D.Ledger().State()
		if err != nil {
			t.Fatal(err)
		}
		return st.Applied
	}
	v0 := r.D.Posterior().Version
	produce(64)
	waitfor.Cond(t, 30*time.Second, "64 applied records", func() bool { return applied() == 64 })

	// The disk refuses writes: the kernel fails every write past a quarter of the ledger's size
	// with EFBIG (RLIMIT_FSIZE applies to the offset written, not only to growth). A limit at the
	// file's size is not enough: bbolt reuses free pages, and a steady stream of checkpoints
	// needs no new ones (tried: 1824 records applied under it).
	path := filepath.Join(r.Config.StateDir, ledger.FileName)
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	lim := syscall.Rlimit{Cur: uint64(fi.Size()/4) &^ 4095, Max: orig.Max}
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		t.Fatal(err)
	}
	t.Logf("RLIMIT_FSIZE = %d bytes (the ledger has %d)", lim.Cur, fi.Size())
	// Increments until one cannot be checkpointed (a commit that reuses free pages can still
	// succeed while the file cannot grow).
	deadline := time.Now().Add(60 * time.Second)
	for r.Metric(t, "cfguard_checkpoint_failures_total") == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no checkpoint failed within 60 s of limiting the ledger to %d bytes (%d records sent, %d applied)", lim.Cur, sent, applied())
		}
		if int64(sent) == applied() {
			produce(32)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Degraded: not ready (naming the ledger, by its file name only: /readyz is open, and server
	// paths stay out of bodies, and the kernel's error), failing gauge set, nothing more applied
	// while it lasts, and the retries (1 s, 2 s, ...) counted.
	code, body := r.Get(t, "/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(string(body), ledger.FileName) || strings.Contains(string(body), path) ||
		!strings.Contains(string(body), syscall.EFBIG.Error()) {
		t.Fatalf("readyz while checkpoints fail: %d %s (want 503 naming %s, not %s, and %q)", code, body, ledger.FileName, path, syscall.EFBIG.Error())
	}
	if r.Metric(t, "cfguard_checkpoint_failing") != 1 {
		t.Fatal("cfguard_checkpoint_failing is not 1 while checkpoints fail")
	}
	// A registration meanwhile is refused with 503 and a Retry-After, nothing stored: the client
	// retries later, as for any unavailable service (not a 500, which says the request was bad
	// for the server).
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	reg, _ := json.Marshal(map[string]any{"id": "during-outage", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})
	resp, rbody := r.RawDo(t, "POST", "/v1/counterfactuals", string(reg), nil)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("registration while the ledger cannot be written: %d (Retry-After %q) %s, want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"), rbody)
	}
	if _, err := r.D.Ledger().Get("during-outage"); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("the refused registration: Get says %v, want not found", err)
	}
	held := applied()
	produce(64) // more records arrive meanwhile: they wait in the topic
	waitfor.Cond(t, 10*time.Second, "a retried checkpoint to fail again", func() bool { return r.Metric(t, "cfguard_checkpoint_failures_total") >= 3 })
	if got := applied(); got != held {
		t.Fatalf("applied %d records while checkpoints failed (was %d)", got, held)
	}
	// The records that wait, the held increment's and the 64 more, are what
	// cfguard_consumer_lag_records counts (CfguardIngestStalled): the topic's end past the
	// ledger's offset, not what the consumer has yet to hand out (it holds them in its backlog).
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("cfguard_consumer_lag_records = %d records waiting", int64(sent)-held), func() bool {
		return r.Metric(t, "cfguard_consumer_lag_records") == float64(int64(sent)-held)
	})
	// The runbook's commands for a ledger that cannot be written, as written, in that state.
	if runbooktest.Tools(t, true) {
		st := &daemontest.RunbookState[*daemon.Daemon]{R: r, Subst: strings.NewReplacer("127.0.0.1:8080", r.D.HTTPAddr(), "STATE_DIR", ledger.ShellQuote(r.Config.StateDir))}
		for name := range daemontest.RunbookInChild {
			st.Run(t, runbooktest.Named(t, daemontest.RunbookPath(t), name))
		}
	} else {
		t.Log("the runbook's commands are not run: a tool is missing")
	}
	// The group's committed offset, as Kafka tooling reads it, never passes the ledger's durable
	// offset: the held increment's offsets (marked durable too early, they would have been
	// committed within a commit interval, seconds ago) are not committed while its checkpoint
	// fails. The commits run in the background: wait for them to reach the durable offset.
	var committed, durable int64
	waitfor.Cond(t, 10*time.Second, "the group's commits to reach the ledger's durable offset", func() bool {
		durable = ledgerOffset(t, r.D.Ledger().Offsets)
		committed = groupCommitted(t, b.Addrs(), r.Config.Kafka.GroupID, r.Config.Kafka.Topic)
		return committed >= durable
	})
	if committed != durable {
		t.Fatalf("the group %q committed offset %d while the ledger's durable offset is %d: offsets were committed before their checkpoint was durable", r.Config.Kafka.GroupID, committed, durable)
	}
	if n := strings.Count(r.Logs.String(), "checkpoint could not be written"); n != 1 {
		t.Fatalf("%d ERROR lines for one episode of failed checkpoints, want 1:\n%s", n, r.Logs.String())
	}
	t.Logf("%v checkpoint attempts failed; readyz: %s", r.Metric(t, "cfguard_checkpoint_failures_total"), strings.TrimSpace(string(body)))

	// Space again: the held increment is retried (within 30 s), then the rest; ready again.
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &orig); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 60*time.Second, "every record applied after the disk has space again", func() bool { return applied() == int64(sent) })
	waitfor.Cond(t, 10*time.Second, "readyz again", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
	waitfor.Cond(t, 10*time.Second, "the group's commits to catch up", func() bool {
		return groupCommitted(t, b.Addrs(), r.Config.Kafka.GroupID, r.Config.Kafka.Topic) == int64(sent)
	})
	st, err := r.D.Ledger().State()
	if err != nil {
		t.Fatal(err)
	}
	// The ledger, and what GET /v1/model reports of the posterior beside it (one snapshot: the
	// posterior swapped in with the checkpoint that stored it).
	incs := uint64(sent / 32)
	v := r.Model(t)
	if st.Applied != int64(sent) || st.Offsets[0] != int64(sent) || st.PosteriorVersion != v0+incs || v.Version != v0+incs || v.Applied != int64(sent) {
		t.Fatalf("after recovery: ledger: applied %d, offset %d, posterior version %d; /v1/model: version %d, applied %d; want %d records in %d increments from version %d",
			st.Applied, st.Offsets[0], st.PosteriorVersion, v.Version, v.Applied, sent, incs, v0)
	}
	// Metrics follow the checkpoint they describe (they are set once it is durable).
	waitfor.Cond(t, 10*time.Second, fmt.Sprintf("cfguard_records_total{result=applied} = %d", sent), func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == float64(sent)
	})
	if r.Metric(t, "cfguard_checkpoint_failing") != 0 {
		t.Fatal("cfguard_checkpoint_failing still 1 after recovery")
	}
	r.Stop(t)
	// One ERROR line per component for the whole episode: the checkpoint's, and the export's when
	// an export fell into it (the same disk refuses it); retries and the refused registration
	// add none.
	var errs []string
	seen := map[string]bool{}
	for _, line := range strings.Split(r.Logs.String(), "\n") {
		if !strings.Contains(line, "level=ERROR") {
			continue
		}
		errs = append(errs, line)
		msg := line[strings.Index(line, "msg="):]
		msg = msg[:strings.Index(msg+" ", "\" ")+1]
		if seen[msg] {
			t.Fatalf("the ERROR line %s is repeated within one episode of failed writes:\n%s", msg, strings.Join(errs, "\n"))
		}
		seen[msg] = true
	}
	if !seen[`msg="checkpoint could not be written; the increment is held, consuming paused, retrying with backoff until it succeeds"`] || len(errs) > 2 {
		t.Fatalf("ERROR lines of one episode of failed writes:\n%s\nwant the checkpoint's, and at most the export's beside it", strings.Join(errs, "\n"))
	}
	if _, err := ledger.Verify(path); err != nil {
		t.Fatalf("the ledger after failed checkpoints: %v", err)
	}
	t.Logf("recovered: %d records in %d increments applied once each", sent, incs)
}

// groupCommitted is the offset the group committed for partition 0 of topic (-1 if none), read
// with OffsetFetch over TCP as Kafka's consumer-group tooling does.
func groupCommitted(t *testing.T, brokers []string, group, topic string) int64 {
	t.Helper()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(brokers...), Timeout: 5 * time.Second}
	res, err := cl.OffsetFetch(context.Background(), &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: {0}}})
	if err == nil && errors.Is(res.Error, kafka.GroupIdNotFound) {
		return -1
	}
	if err != nil || res.Error != nil || len(res.Topics[topic]) != 1 {
		t.Fatalf("OffsetFetch(%s): %v %v %+v", group, err, res.Error, res)
	}
	if e := res.Topics[topic][0].Error; e != nil {
		t.Fatalf("OffsetFetch(%s, %s/0): %v", group, topic, e)
	}
	return res.Topics[topic][0].CommittedOffset
}

// ledgerOffset is the ledger's durable offset of partition 0.
func ledgerOffset(t *testing.T, offsets func() (map[int]int64, error)) int64 {
	t.Helper()
	o, err := offsets()
	if err != nil {
		t.Fatal(err)
	}
	return o[0]
}

// TestCheckpointFailureHoldsTheIncrement: a checkpoint that cannot be written (a real EFBIG from
// the kernel, see TestCheckpointFailureChild) holds the increment: posterior and offsets stay,
// nothing more is consumed, /readyz is false naming the ledger and the error,
// cfguard_checkpoint_failures_total counts the attempts, one ERROR line is logged; once writing
// works the same increment is applied, then the rest: every record applied exactly once.
func TestCheckpointFailureHoldsTheIncrement(t *testing.T) {
	t.Parallel() // mostly waits for its child process
	runFsizeChild(t, "TestCheckpointFailureChild", "1")
}

// runFsizeChild runs the test named child in a child process with fsizeChildEnv set to value
// and fails unless it passes.
func runFsizeChild(t *testing.T, child, value string) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a child process")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+child+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), fsizeChildEnv+"="+value)
	out, err := cmd.CombinedOutput()
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if line := sc.Text(); strings.Contains(line, "writefail_test.go") || strings.Contains(line, "FAIL") {
			t.Log(line)
		}
	}
	if err != nil || !strings.Contains(string(out), "--- PASS: "+child) {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// TestFailedRegistrationOnAQuietDaemon: with no record arriving, nothing checkpoints, so only
// registrations meet a ledger that cannot be written (a real EFBIG, as in
// TestQuietLedgerFailureChild). The daemon says so: /readyz 503 naming the ledger and the error
// while commits fail, cfguard_ledger_write_failures_total and cfguard_ledger_write_failing 1
// (CfguardCheckpointFailing), and the runbook's commands show it; once the disk has room the
// registration sent again is stored, and /readyz and the gauge are ready again once the hold has
// passed.
func TestFailedRegistrationOnAQuietDaemon(t *testing.T) {
	t.Parallel() // mostly waits for its child process
	runFsizeChild(t, "TestQuietLedgerFailureChild", "quiet")
}

// TestQuietLedgerFailureChild is the child process of TestFailedRegistrationOnAQuietDaemon.
func TestQuietLedgerFailureChild(t *testing.T) {
	// ledgerFailureHold in this test: half the default, and long enough that the checks after a
	// failure (a readyz, the metrics, the runbook's commands) run within it on a busy machine.
	const hold = 30 * time.Second
	r, _, orig := fsizeChild(t, "quiet", "TestFailedRegistrationOnAQuietDaemon", func(o *daemon.Options) { o.Hooks.LedgerFailureHold = hold })
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	reg, _ := json.Marshal(map[string]any{"id": "quiet", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})

	// Every commit fails: a limit of one page leaves bbolt's first meta page writable and nothing
	// else, and a commit writes a data page and the other meta page at least.
	lim := syscall.Rlimit{Cur: 4096, Max: orig.Max}
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(r.Config.StateDir, ledger.FileName)
	for i := range 2 { // a client sending it again meets the same refusal, and /readyz says so
		resp, rbody := r.RawDo(t, "POST", "/v1/counterfactuals", string(reg), nil)
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("registration %d while the ledger cannot be written: %d %s, want 503", i, resp.StatusCode, rbody)
		}
		code, body := r.Get(t, "/readyz")
		if code != http.StatusServiceUnavailable || !strings.Contains(string(body), ledger.FileName) || strings.Contains(string(body), path) ||
			!strings.Contains(string(body), syscall.EFBIG.Error()) {
			t.Fatalf("readyz after registration %d the ledger could not store: %d %s (want 503 naming %s, not %s, and %q)", i, code, body, ledger.FileName, path, syscall.EFBIG.Error())
		}
		if got := r.Metric(t, "cfguard_ledger_write_failures_total"); got != float64(i+1) {
			t.Fatalf("cfguard_ledger_write_failures_total %v after %d failed registrations", got, i+1)
		}
		if got := r.Metric(t, "cfguard_ledger_write_failing"); got != 1 {
			t.Fatalf("cfguard_ledger_write_failing %v after %d failed registrations, want 1", got, i+1)
		}
	}
	if at := r.Metric(t, "cfguard_ledger_write_failure_last_timestamp_seconds"); time.Since(time.Unix(int64(at), 0)) > time.Minute {
		t.Fatalf("cfguard_ledger_write_failure_last_timestamp_seconds %v, want the time of the last failed registration", at)
	}
	if got := r.Metric(t, "cfguard_checkpoint_failing"); got != 0 {
		t.Fatalf("cfguard_checkpoint_failing %v with no checkpoint tried, want 0", got)
	}
	// The runbook's commands, as written, show it.
	if runbooktest.Tools(t, true) {
		subst := strings.NewReplacer("127.0.0.1:8080", r.D.HTTPAddr(), "STATE_DIR", ledger.ShellQuote(r.Config.StateDir))
		runbooktest.Run(t, runbooktest.Named(t, daemontest.RunbookPath(t), "CfguardCheckpointFailing"), []runbooktest.Check{
			{Cmd: "/readyz", Want: `a commit to the ledger cfguard\.db failed .* ago, at .*file too large`},
			{Cmd: "df -h", Want: `(?s)Filesystem.*\n.*%`},
		}, subst, daemontest.RunbookNotRun)
	}

	// Room again: the registration sent again is stored, and /readyz is ready once the hold has
	// passed since the last failure.
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &orig); err != nil {
		t.Fatal(err)
	}
	if resp, rbody := r.RawDo(t, "POST", "/v1/counterfactuals", string(reg), nil); resp.StatusCode != http.StatusCreated {
		t.Fatalf("the registration sent again once the disk has room: %d %s, want 201", resp.StatusCode, rbody)
	}
	waitfor.Cond(t, hold+time.Minute, "readyz once the hold has passed", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
	if got := r.Metric(t, "cfguard_ledger_write_failing"); got != 0 {
		t.Fatalf("cfguard_ledger_write_failing %v once the hold has passed, want 0", got)
	}
	if got := r.Metric(t, "cfguard_ledger_write_failures_total"); got != 2 {
		t.Fatalf("cfguard_ledger_write_failures_total %v after recovery, want the 2 failures", got)
	}
	r.Stop(t)
	if _, err := ledger.Verify(path); err != nil {
		t.Fatalf("the ledger after failed registrations: %v", err)
	}
}
