package daemon

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// runbookSection is one "## Alert" section of docs/RUNBOOK.md: the lines of its ```sh blocks.
type runbookSection struct {
	name     string
	commands []string
}

// runbookSections reads the fenced ```sh blocks of docs/RUNBOOK.md, section by section; every
// non-empty line of a block is one command.
func runbookSections(t *testing.T) []runbookSection {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join("..", "docs", "RUNBOOK.md"))
	if err != nil {
		t.Fatal(err)
	}
	var out []runbookSection
	in := false
	sc := bufio.NewScanner(bytes.NewReader(doc))
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "## "):
			out = append(out, runbookSection{name: strings.TrimSpace(l[3:])})
		case l == "```sh":
			in = true
		case in && l == "```":
			in = false
		case in && strings.TrimSpace(l) != "":
			if len(out) == 0 {
				t.Fatalf("docs/RUNBOOK.md: command %q before the first section", l)
			}
			out[len(out)-1].commands = append(out[len(out)-1].commands, l)
		}
	}
	if in {
		t.Fatal("docs/RUNBOOK.md: a ```sh block is not closed")
	}
	return out
}

// runbookCheck says what one runbook command (the one containing cmd) must print in the state
// of its alert: want matches its output (stdout and stderr).
type runbookCheck struct {
	cmd  string
	want string
}

// runbookReplicaSections are the replicas' alerts (replication.enabled): their commands read a
// replica's /v1/model replication block and the posterior topic; this test, which runs single
// nodes, does not run them.
var runbookReplicaSections = map[string]bool{
	"CfguardReplicationUnauthenticated": true, "CfguardPosteriorLogStopped": true, "CfguardPosteriorLogBehind": true,
}

// runbookChecks: for every single-node alert, what each of its commands prints against the
// daemon of TestRunbookCommandsRun that is in its state. A command the table does not know fails the test,
// so a new runbook command comes with its check.
var runbookChecks = map[string][]runbookCheck{
	"CfguardKLOverBudget": {
		{"/v1/model ", `"kl_history":\[.*"outcome":"promoted"`},
		{"kl_breach_last_timestamp_seconds|kl_over_budget|kl_budget", `(?m)^cfguard_kl_breach_last_timestamp_seconds [1-9][0-9.e+]*$[\s\S]*^cfguard_kl_budget 0\.10125$[\s\S]*^cfguard_kl_over_budget [01]$`},
		{"grep kl_over_budget", `"type":"kl_over_budget".*"policy":"alert"`},
	},
	"CfguardCounterfactualsInvalidated": {
		{"status=invalidated", `"status":"invalidated"`},
		{"/ID     # its history", `"history":\[.*"to":"invalidated"`},
		{"/v1/explain", `(?s)^\{.*("status":"certified".*\n201|"error":"no valid counterfactual found: .*\n422)$`},
		{"-XDELETE", `^204$`},
	},
	"CfguardCounterfactualsAtRisk": {
		{"status=at_risk", `"status":"at_risk".*"decided":(true|false)`},
		{"-XPOST 127.0.0.1:8080/v1/audit", `"counts":\{"at_risk":8,.*"evaluated":8,`},
		{"/v1/audit ", `"last":\{.*"evaluated":8`},
	},
	"CfguardRenewalBehind": {
		{"/readyz", `"status":"ready"`},
		{"counterfactuals_(renewal_pending", `(?m)^cfguard_counterfactuals_renewal_pending 0$[\s\S]*^cfguard_counterfactuals_unconfirmed 0$`},
	},
	"CfguardIngestStalled": {
		{"/readyz", `checkpoint to cfguard\.db failing since .*file too large`},
		{"consumer_lag_records|checkpoint_failing", `(?m)^cfguard_checkpoint_failing 1$[\s\S]*^cfguard_consumer_lag_records [1-9][0-9]*$`},
	},
	"CfguardDeadLetterRateHigh": {
		{"cfguard.records.dlq", `(?m)^\s*[0-9]+ .*cfguard-reason=`},
	},
	"CfguardCheckpointFailing": {
		{"/readyz", `checkpoint to cfguard\.db failing since .*file too large`},
		{"df -h", `(?s)Filesystem.*\n.*%`},
	},
	"CfguardOutboxBacklog": {
		{"cfguard_events_(pending|total)", `(?m)^cfguard_events_pending [1-9][0-9]*$[\s\S]*^cfguard_events_total\{result="failed"\} [1-9]`},
		{"kcat -L", `topic "cfguard.events" with 0 partitions: Broker: Unknown topic or partition`},
	},
	"CfguardTopicReset": {
		{"/readyz", `topic cfguard.records partition 0 was reset.*--accept-topic-reset`},
		{"kcat -Q", `cfguard.records \[0\] offset 96\b`},
		{"--accept-topic-reset", ""}, // starts a daemon: see runbookNotRun
	},
	"CfguardModelQualityDegraded": {
		{"jq '.prequential'", `"last_change": "20`},
		{"prequential_(log_loss", `(?m)^cfguard_prequential_last_change_timestamp_seconds [1-9]`},
		{"kl_history[-20:]", `"outcome":`},
	},
}

// runbookNotRun are commands this test does not run, each with the test that covers it.
var runbookNotRun = map[string]string{
	"--accept-topic-reset": "it starts a daemon that reads the reset topic from its start: TestRecreatedTopicStopsIngestUntilConfirmed restarts with the flag's option (Options.AcceptTopicReset)",
}

// TestRunbookCommandsRun runs every command of docs/RUNBOOK.md's single-node sections as written
// (the API's and the broker's address, the state directory and a CE's id for ID substituted)
// with bash against live daemons, and checks that each exits 0 (pipefail) and prints what
// runbookChecks says its section says it shows. The daemons are in the state of the alerts:
// CEs at_risk, CEs invalidated after a drift that breached the KL budget and dead-lettered
// records (CfguardKLOverBudget, CfguardCounterfactualsInvalidated, CfguardDeadLetterRateHigh),
// a change the quality detector found (CfguardModelQualityDegraded), a recreated input topic
// (CfguardTopicReset), a deleted events topic (CfguardOutboxBacklog; the test then creates it
// and the backlog drains). CfguardCheckpointFailing's and CfguardIngestStalled's run in the
// child process of TestCheckpointFailureHoldsTheIncrement, whose ledger cannot be written while
// records wait in the topic (runbookInChild). CfguardRenewalBehind's run against the drifted
// daemon, whose renewals are done: its commands are checked to run and print the healthy values
// (an empty backlog). curl, kcat, jq and df run for real; the test skips when one is
// missing unless CFGUARD_REQUIRE_TOOLS=1.
func TestRunbookCommandsRun(t *testing.T) {
	runbookTools(t, false)
	sections := runbookSections(t)
	// Every command is known before the daemon starts.
	var run []runbookSection
	for _, s := range sections {
		if len(s.commands) == 0 {
			continue
		}
		if runbookReplicaSections[s.name] {
			t.Logf("%s: %d commands not run here (a replica's alert)", s.name, len(s.commands))
			continue
		}
		checks, ok := runbookChecks[s.name]
		if !ok {
			t.Errorf("docs/RUNBOOK.md section %s has commands and no checks in runbookChecks", s.name)
			continue
		}
		for _, c := range s.commands {
			if n := len(matchingChecks(checks, c)); n != 1 {
				t.Errorf("%s: command %q matches %d checks, want 1", s.name, c, n)
			}
		}
		for _, ch := range checks {
			found := false
			for _, c := range s.commands {
				found = found || strings.Contains(c, ch.cmd)
			}
			if !found {
				t.Errorf("%s: runbookChecks expects a command containing %q that the section does not have", s.name, ch.cmd)
			}
		}
		run = append(run, s)
	}
	if t.Failed() {
		t.FailNow()
	}

	// Three states: CEs at_risk; CEs invalidated (the state of every other section but one);
	// a model that learns so slowly that mislabelled records keep scoring badly after clean
	// ones, so that the change detector fires.
	atRisk := driftedDaemon(t, 1e-3, 0, 128, certify.AtRisk)
	invalidated := driftedDaemon(t, 1e-3, 64, 160, certify.Invalidated)
	quality := driftedDaemon(t, 1e-6, 256, 256, 0)
	reset := resetDaemon(t)
	backlog := outboxDaemon(t)
	for _, s := range run {
		st := invalidated
		switch s.name {
		case "CfguardCounterfactualsAtRisk":
			st = atRisk
		case "CfguardModelQualityDegraded":
			st = quality
		case "CfguardTopicReset":
			st = reset
		case "CfguardOutboxBacklog":
			st = backlog
		}
		if runbookInChild[s.name] {
			t.Logf("%s: run by TestCheckpointFailureChild, in the alert's state", s.name)
			continue
		}
		runRunbookSection(t, s, st)
	}
	// The remedy of CfguardOutboxBacklog: with the events topic back, the backlog drains.
	createTopic(t, backlog.r.d.BrokerAddrs(), backlog.r.d.cfg.Kafka.EventsTopic)
	waitfor.Cond(t, 60*time.Second, "the outbox to drain once the events topic exists again", func() bool {
		return backlog.r.metric(t, "cfguard_events_pending") == 0
	})
	// The runbook's DELETE removed the invalidated CE the re-issue was for.
	if _, err := invalidated.r.d.ledger.Get(invalidated.id); err == nil {
		t.Errorf("%s is still stored after the runbook's DELETE", invalidated.id)
	}
}

// runbookState is a live daemon in the state of some alerts, and the substitutions that point a
// runbook command at it.
type runbookState struct {
	r     *running
	id    string // a CE of the state's status, for ID
	subst *strings.Replacer
}

// driftedDaemon starts a daemon whose learner's steps the learning rate lr caps (paperLearner),
// registers 8 CEs, and produces cleans records with the data's labels, then flips records of
// benign rows labelled malignant (an update breaches the KL budget, the certificates lapse and
// are judged; after clean records, the change detector fires), and 3 malformed records
// (dead-lettered). It waits until every CE has its verdict and every
// event is published, and requires every CE to be judged want (unless want is 0).
func driftedDaemon(t *testing.T, lr float64, cleans, flips int, want certify.Status) *runbookState {
	t.Helper()
	r := startDaemon(t, func(c *config.Config) { paperLearner(c, lr) })
	data := bundled(t)
	registerCEs(t, r, data, 8)
	bad := [][]byte{[]byte("not json"), record("short", []float64{1, 2}, 0), record("alien", data.X[0], "alien")}
	var clean [][]byte
	for i := range cleans {
		clean = append(clean, record(fmt.Sprintf("clean%d", i), data.X[i], data.Y[i]))
	}
	r.produce(t, append(append(clean, flipped(data, flips)...), bad...)...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and the bad records dead-lettered", func() bool {
		return r.metric(t, "cfguard_records_total", "result", "applied") == float64(len(clean)+flips) &&
			r.metric(t, "cfguard_records_total", "result", "dead_lettered") == 3
	})
	waitfor.Cond(t, 60*time.Second, "every lapsed certificate judged, every event published", func() bool {
		return r.metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && r.metric(t, "cfguard_counterfactuals_unconfirmed") == 0 &&
			r.metric(t, "cfguard_events_pending") == 0
	})
	counts, err := r.d.ledger.Counts()
	if err != nil {
		t.Fatal(err)
	}
	if want != 0 && counts[want] != 8 {
		t.Fatalf("%d flipped records left the CEs %v, want all 8 %v", flips, counts, want)
	}
	page, err := r.d.ledger.List(want, 1, "")
	if err != nil || len(page) == 0 {
		t.Fatalf("no %v CE listed: %v", want, err)
	}
	return &runbookState{r: r, id: page[0].ID, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.d.HTTPAddr(),
		"127.0.0.1:9092", r.d.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.d.cfg.StateDir),
		"/ID", "/"+page[0].ID,
	)}
}

// runbookInChild are the sections whose state is a ledger that cannot be written: the child
// process of TestCheckpointFailureHoldsTheIncrement, under RLIMIT_FSIZE, runs them
// (runbookSectionNamed) while its checkpoints fail.
var runbookInChild = map[string]bool{"CfguardCheckpointFailing": true, "CfguardIngestStalled": true}

// runRunbookSection runs the commands of s with bash against st and checks their output.
func runRunbookSection(t *testing.T, s runbookSection, st *runbookState) {
	t.Helper()
	for _, c := range s.commands {
		checks := matchingChecks(runbookChecks[s.name], c)
		if len(checks) != 1 {
			t.Errorf("%s: command %q matches %d checks, want 1", s.name, c, len(checks))
			continue
		}
		ch := checks[0]
		if why, skip := runbookNotRun[ch.cmd]; skip {
			t.Logf("%s: not run: %s (%s)", s.name, c, why)
			continue
		}
		line := st.subst.Replace(c)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		cmd := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c", line)
		out, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			t.Errorf("%s: %s: %v\n%s", s.name, line, err, out)
			continue
		}
		if !regexp.MustCompile(ch.want).Match(bytes.TrimSpace(out)) {
			t.Errorf("%s: %s printed\n%s\nwant it to match %s", s.name, line, clip(out), ch.want)
			continue
		}
		t.Logf("%s: ran %s (%d bytes of output, as the runbook says)", s.name, c, len(out))
	}
}

// runbookSectionNamed returns the section of docs/RUNBOOK.md named name, failing without one.
func runbookSectionNamed(t *testing.T, name string) runbookSection {
	t.Helper()
	for _, s := range runbookSections(t) {
		if s.name == name {
			return s
		}
	}
	t.Fatalf("docs/RUNBOOK.md has no section %s", name)
	return runbookSection{}
}

// runbookTools reports whether the tools the runbook's commands use are on PATH; when one is
// not, it calls tooltest.Missing (a skip, or a failure with CFGUARD_REQUIRE_TOOLS=1) unless
// quiet, in which case it only reports false.
func runbookTools(t *testing.T, quiet bool) bool {
	t.Helper()
	for _, tool := range []string{"bash", "curl", "kcat", "jq", "df", "sort", "uniq"} {
		if _, err := exec.LookPath(tool); err != nil {
			if !quiet || os.Getenv(tooltest.RequireEnv) == "1" {
				tooltest.Missing(t, tool+" not on PATH", "apt-get install kcat curl jq")
			}
			return false
		}
	}
	return true
}

func matchingChecks(checks []runbookCheck, command string) []runbookCheck {
	var out []runbookCheck
	for _, ch := range checks {
		if strings.Contains(command, ch.cmd) {
			out = append(out, ch)
		}
	}
	return out
}

// clip shortens a command's output for an error message.
func clip(b []byte) string {
	if len(b) > 2000 {
		return fmt.Sprintf("%s ... (%d bytes)", b[:2000], len(b))
	}
	return string(b)
}

// resetDaemon is a daemon whose input topic was deleted and recreated after it applied 64
// records, and that holds 96 new ones: ingest stopped (CfguardTopicReset).
func resetDaemon(t *testing.T) *runbookState {
	t.Helper()
	r := startDaemon(t, nil)
	data := bundled(t)
	records := func(prefix string, n int) [][]byte {
		var out [][]byte
		for i := range n {
			out = append(out, record(fmt.Sprintf("%s%d", prefix, i), data.X[i], data.Y[i]))
		}
		return out
	}
	r.produce(t, records("old", 64)...)
	waitfor.Cond(t, 30*time.Second, "64 applied records", func() bool { return r.metric(t, "cfguard_records_total", "result", "applied") == 64 })
	recreate(t, r.d.BrokerAddrs(), r.d.cfg.Kafka.Topic)
	r.produce(t, records("new", 96)...)
	waitfor.Cond(t, 30*time.Second, "ingest stopped for the reset", func() bool {
		code, body := r.get(t, "/readyz")
		return code == 503 && strings.Contains(string(body), "was reset")
	})
	// The 96 records of the new log wait, although the ledger's offset (64) is below its end:
	// CfguardIngestStalled can fire beside CfguardTopicReset.
	waitfor.Cond(t, 30*time.Second, "cfguard_consumer_lag_records to count the new log's 96 records", func() bool {
		return r.metric(t, "cfguard_consumer_lag_records") == 96
	})
	return &runbookState{r: r, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.d.HTTPAddr(),
		"127.0.0.1:9092", r.d.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.d.cfg.StateDir),
	)}
}

// outboxDaemon is a daemon whose events topic was deleted before a drift changed the status of
// its CEs: status changes wait in the outbox and every publish attempt fails
// (CfguardOutboxBacklog).
func outboxDaemon(t *testing.T) *runbookState {
	t.Helper()
	r := startDaemon(t, func(c *config.Config) { paperLearner(c, 1e-3) })
	data := bundled(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(r.d.BrokerAddrs()...)}
	topic := r.d.cfg.Kafka.EventsTopic
	if res, err := cl.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}}); err != nil || res.Errors[topic] != nil {
		t.Fatalf("deleting %s: %v %v", topic, err, res)
	}
	registerCEs(t, r, data, 4)
	r.produce(t, flipped(data, 96)...)
	waitfor.Cond(t, 60*time.Second, "events waiting in the outbox after failed publish attempts", func() bool {
		return r.metric(t, "cfguard_events_pending") > 0 && r.metric(t, "cfguard_events_total", "result", "failed") > 0
	})
	return &runbookState{r: r, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.d.HTTPAddr(),
		"127.0.0.1:9092", r.d.BrokerAddrs()[0],
	)}
}

// createTopic creates topic with one partition.
func createTopic(t *testing.T, brokers []string, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(brokers...)}
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[topic] != nil {
		t.Fatalf("creating %s: %v %v", topic, err, res)
	}
}
