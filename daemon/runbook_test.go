package daemon

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// runbookPath is the runbook, from the package's directory.
var runbookPath = filepath.Join("..", "docs", "RUNBOOK.md")

// runbookReplicaSections are the replicas' alerts (replication.enabled), run in the state each
// describes by the test named: their commands read replicas' /v1/model, /metrics and the
// posterior topic.
var runbookReplicaSections = map[string]string{
	"CfguardReplicationUnauthenticated": "daemon/internal/tests/replicalog TestForgedRecordsAreRefusedByEveryReplica, after forged records",
	"CfguardPosteriorLogRefused":        "daemon/internal/tests/replicalog TestForgedRecordsAreRefusedByEveryReplica, after signed entries every replica refuses",
	"CfguardPosteriorLogStopped":        "cmd/cfguard/internal/tests/replicalog TestNewEpochResumesStoppedReplicas, while the replicas are stopped",
	"CfguardPosteriorLogBehind":         "cmd/cfguard/internal/tests/replicalog TestFollowerBehindTheLog, while a follower's disk refuses its ledger's writes",
	"CfguardCounterfactualsNotCaughtUp": "TestRebuildThatCannotFetch, while the broker refuses the fetches of a partition being rebuilt",
	"CfguardReplicaSettingsDiffer":      "daemon/internal/tests/replicalog TestReplicaSettingsMustMatchTheGenesis, at a replica with another certify.delta",
}

// runbookChecks: for every single-node alert, what each of its commands prints against the
// daemon of TestRunbookCommandsRun that is in its state. A command the table does not know fails the test,
// so a new runbook command comes with its check.
var runbookChecks = map[string][]runbooktest.Check{
	"CfguardKLOverBudget": {
		{Cmd: "/v1/model ", Want: `"kl_history":\[.*"outcome":"promoted"`},
		{Cmd: "kl_breach_last_timestamp_seconds|kl_over_budget|kl_budget", Want: `(?m)^cfguard_kl_breach_last_timestamp_seconds [1-9][0-9.e+]*$[\s\S]*^cfguard_kl_budget 0\.10125$[\s\S]*^cfguard_kl_over_budget [01]$`},
		{Cmd: "grep kl_over_budget", Want: `"type":"kl_over_budget".*"policy":"alert"`},
	},
	"CfguardCounterfactualsInvalidated": {
		{Cmd: "status=invalidated", Want: `"status":"invalidated"`},
		{Cmd: "/ID     # its history", Want: `"history":\[.*"to":"invalidated"`},
		{Cmd: "/v1/explain", Want: `(?s)^\{.*("status":"certified".*\n201|"error":"(no valid counterfactual found|generated but not stored: outside the <delta, epsilon>-set): .*\n422)$`},
		{Cmd: "-XDELETE", Want: `^204$`},
	},
	"CfguardCounterfactualsAtRisk": {
		{Cmd: "status=at_risk", Want: `"status":"at_risk".*"decided":(true|false)`},
		{Cmd: "-XPOST 127.0.0.1:8080/v1/audit", Want: `"counts":\{"at_risk":8,.*"evaluated":8,`},
		{Cmd: "/v1/audit ", Want: `"last":\{.*"evaluated":8`},
	},
	"CfguardRenewalBehind": {
		{Cmd: "/readyz", Want: `"status":"ready"`},
		{Cmd: "counterfactuals_(renewal_pending", Want: `(?m)^cfguard_counterfactuals_measured_total\{result="kept"\} 0$[\s\S]*^cfguard_counterfactuals_renewal_pending [1-9][0-9]*$[\s\S]*^cfguard_counterfactuals_unconfirmed [1-9][0-9]*$`},
	},
	"CfguardIngestStalled": {
		{Cmd: "/readyz", Want: `checkpoint to cfguard\.db failing since .*file too large`},
		{Cmd: "consumer_lag_records|consumer_offsets_read_timestamp_seconds|checkpoint_failing|records_total", Want: `(?m)^cfguard_checkpoint_failing 1$[\s\S]*^cfguard_consumer_lag_records [1-9][0-9]*$[\s\S]*^cfguard_consumer_offsets_read_timestamp_seconds [1-9][0-9.e+]*$[\s\S]*^cfguard_records_total\{result="applied"\} [1-9][0-9]*$`},
	},
	"CfguardDeadLetterRateHigh": {
		{Cmd: "cfguard.records.dlq", Want: `(?m)^\s*2 cfguard-reason=bad_json\n\s*1 cfguard-reason=[a-z_]+\n\s*1 cfguard-reason=[a-z_]+$`},
	},
	"CfguardUpdatesFailing": {
		{Cmd: "records_total|update_failed_last_timestamp_seconds|updates_total", Want: `(?m)^cfguard_records_total\{result="failed"\} 32$[\s\S]*^cfguard_update_failed_last_timestamp_seconds [1-9]\.[0-9]+e\+09$[\s\S]*^cfguard_updates_total\{outcome="failed"\} 1$`},
		{Cmd: `select(.type == "update_failed")`, Want: `^\{"posterior_version":[0-9]+,"offsets":\[\{"partition":0,"first":0,"last":31\}\],"error":"update: .+"\}$`},
	},
	"CfguardDown": {
		{Cmd: "/healthz", Want: `^000$`},
	},
	"CfguardCheckpointFailing": {
		{Cmd: "/readyz", Want: `checkpoint to cfguard\.db failing since .*file too large`},
		{Cmd: "df -h", Want: `(?s)Filesystem.*\n.*%`},
	},
	"CfguardOutboxBacklog": {
		{Cmd: "cfguard_events_(pending|total)", Want: `(?m)^cfguard_events_pending [1-9][0-9]*$[\s\S]*^cfguard_events_total\{result="failed"\} [1-9]`},
		{Cmd: "kcat -L", Want: `topic "cfguard.events" with 0 partitions: Broker: Unknown topic or partition`},
	},
	"CfguardTopicReset": {
		{Cmd: "/readyz", Want: `topic cfguard.records partition 0 was reset.*--accept-topic-reset`},
		{Cmd: "kcat -Q", Want: `cfguard.records \[0\] offset 96\b`},
		{Cmd: "--accept-topic-reset", Want: ""}, // starts a daemon: see runbookNotRun
	},
	"CfguardRecordsLost": {
		{Cmd: "^cfguard_records_lost_(total", Want: `(?m)^cfguard_records_lost_last_timestamp_seconds\{topic="cfguard\.records"\} 1\.[0-9.e+]+$[\s\S]*^cfguard_records_lost_total\{topic="cfguard\.records"\} 32$`},
		{Cmd: "jq -c .counters", Want: `"consumer_lost":32\b`},
		{Cmd: "kcat -Q", Want: `cfguard.records \[0\] offset 96\b`},
	},
	"CfguardModelQualityDegraded": {
		{Cmd: "jq '.prequential'", Want: `"last_change": "20`},
		{Cmd: "prequential_(log_loss", Want: `(?m)^cfguard_prequential_last_change_timestamp_seconds [1-9]`},
		{Cmd: "kl_history[-20:]", Want: `"outcome":`},
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
// (CfguardTopicReset), input records deleted by retention before they were read
// (CfguardRecordsLost, lostDaemon), a deleted events topic (CfguardOutboxBacklog; the test
// then creates it and the backlog drains). CfguardCheckpointFailing's and CfguardIngestStalled's run in the
// child process of TestCheckpointFailureHoldsTheIncrement, whose ledger cannot be written while
// records wait in the topic (runbookInChild). CfguardRenewalBehind's run against a daemon whose
// confirmers are held after a drift lapsed its certificates (behindDaemon); released, its
// backlog empties. CfguardUpdatesFailing's run against a daemon whose updates fail
// (failingDaemon). CfguardDown's run against an address where nothing listens (downState).
// curl, kcat, jq and df run for real; the test skips when one is missing unless
// CFGUARD_REQUIRE_TOOLS=1.
func TestRunbookCommandsRun(t *testing.T) {
	t.Parallel() // mostly waits for its daemons to reach their states and for the commands
	runbooktest.Tools(t, false)
	sections := runbooktest.Sections(t, runbookPath)
	// Every command is known before the daemon starts.
	var run []runbooktest.Section
	for _, s := range sections {
		if len(s.Commands) == 0 {
			continue
		}
		if by, ok := runbookReplicaSections[s.Name]; ok {
			t.Logf("%s: %d commands run by %s", s.Name, len(s.Commands), by)
			continue
		}
		checks, ok := runbookChecks[s.Name]
		if !ok {
			t.Errorf("docs/RUNBOOK.md section %s has commands and no checks in runbookChecks", s.Name)
			continue
		}
		runbooktest.Covered(t, s, checks)
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
	lost, _ := lostDaemon(t)
	backlog := outboxDaemon(t)
	behind, release := behindDaemon(t)
	failing := failingDaemon(t)
	down := downState(t)
	for _, s := range run {
		st := invalidated
		switch s.Name {
		case "CfguardCounterfactualsAtRisk":
			st = atRisk
		case "CfguardModelQualityDegraded":
			st = quality
		case "CfguardTopicReset":
			st = reset
		case "CfguardRecordsLost":
			st = lost
		case "CfguardOutboxBacklog":
			st = backlog
		case "CfguardRenewalBehind":
			st = behind
		case "CfguardUpdatesFailing":
			st = failing
		case "CfguardDown":
			st = down
		}
		if runbookInChild[s.Name] {
			t.Logf("%s: run by TestCheckpointFailureChild, in the alert's state", s.Name)
			continue
		}
		st.run(t, s)
	}
	// The remedy of CfguardOutboxBacklog: with the events topic back, the backlog drains.
	createTopic(t, backlog.r.D.BrokerAddrs(), backlog.r.D.cfg.Kafka.EventsTopic)
	waitfor.Cond(t, 60*time.Second, "the outbox to drain once the events topic exists again", func() bool {
		return backlog.r.Metric(t, "cfguard_events_pending") == 0
	})
	// CfguardRenewalBehind's condition ends once the confirmers get the CPU they lacked: the
	// backlog empties, each lapsed certificate renewed or judged.
	release()
	waitfor.Cond(t, 60*time.Second, "the renewal backlog to empty once the confirmers run", func() bool {
		return behind.r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0
	})
	// The runbook's DELETE removed the invalidated CE the re-issue was for.
	if _, err := invalidated.r.D.ledger.Get(invalidated.id); err == nil {
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

// driftedDaemon starts a daemon whose learner's steps the learning rate lr caps (daemontest.PaperLearner),
// registers 8 CEs, and produces cleans records with the data's labels, then flips records of
// benign rows labelled malignant (an update breaches the KL budget, the certificates lapse and
// are judged; after clean records, the change detector fires), and 4 malformed records
// (dead-lettered, two of them for one reason). It waits until every CE has its verdict and every
// event is published, and requires every CE to be judged want (unless want is 0).
func driftedDaemon(t *testing.T, lr float64, cleans, flips int, want certify.Status) *runbookState {
	t.Helper()
	r := startDaemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		daemontest.PaperLearner(c, lr)
		// The runbook's re-issue (POST /v1/explain) is checked for the search's verdict (201 or
		// 422), which on a core shared with 20 busy processes takes more than the default minute.
		c.Explain.Timeout = 10 * time.Minute
	}))
	data := daemontest.Bundled(t)
	daemontest.RegisterCEs(t, r, data, 8, "")
	bad := [][]byte{[]byte("not json"), daemontest.Record("short", []float64{1, 2}, 0), daemontest.Record("alien", data.X[0], "alien"), []byte("{")}
	var clean [][]byte
	for i := range cleans {
		clean = append(clean, daemontest.Record(fmt.Sprintf("clean%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, append(append(clean, daemontest.Flipped(data, flips)...), bad...)...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and the bad records dead-lettered", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == float64(len(clean)+flips) &&
			r.Metric(t, "cfguard_records_total", "result", "dead_lettered") == float64(len(bad))
	})
	waitfor.Cond(t, 60*time.Second, "every lapsed certificate judged, every event published", func() bool {
		return r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0 &&
			r.Metric(t, "cfguard_events_pending") == 0
	})
	counts, err := r.D.ledger.Counts()
	if err != nil {
		t.Fatal(err)
	}
	if want != 0 && counts[want] != 8 {
		t.Fatalf("%d flipped records left the CEs %v, want all 8 %v", flips, counts, want)
	}
	page, err := r.D.ledger.List(want, 1, "")
	if err != nil || len(page) == 0 {
		t.Fatalf("no %v CE listed: %v", want, err)
	}
	return &runbookState{r: r, id: page[0].ID, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.D.cfg.StateDir),
		"/ID", "/"+page[0].ID,
	)}
}

// behindDaemon is a daemon whose confirmers are held before their first round, as a starved CPU
// holds them, while flipped records lapse the certificates of its 8 CEs: the renewal backlog
// stays (CfguardRenewalBehind), its CEs certified with renewal_pending. release lets the
// confirmers run.
func behindDaemon(t *testing.T) (st *runbookState, release func()) {
	t.Helper()
	held := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	r := startDaemonWith(t, daemontest.WithSharedVAE(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) }), func(o *Options) {
		o.hooks.confirmRound = func(ctx context.Context) {
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
	}, nil)
	data := daemontest.Bundled(t)
	daemontest.RegisterCEs(t, r, data, 8, "")
	r.Produce(t, daemontest.Flipped(data, 128)...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and certificates lapsed, waiting for the confirmers", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 128 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") > 0
	})
	return &runbookState{r: r, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.D.cfg.StateDir),
	)}, release
}

// failingDaemon serves a model whose every update fails (overflowingModel), and has failed one
// update of 32 records (CfguardUpdatesFailing), its update_failed event published.
func failingDaemon(t *testing.T) *runbookState {
	t.Helper()
	data := daemontest.Bundled(t)
	r := startDaemon(t, func(c *config.Config) { c.Model.Path = overflowingModel(t) })
	var vals [][]byte
	for i := 0; i < 32; i++ {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, vals...)
	waitfor.Cond(t, 30*time.Second, "one failed update of 32 records, its event published", func() bool {
		return r.Metric(t, "cfguard_updates_total", "outcome", "failed") == 1 && r.Metric(t, "cfguard_events_pending") == 0
	})
	return &runbookState{r: r, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
	)}
}

// downState points the runbook at an address where no daemon listens (CfguardDown): a loopback
// port bound and never listened on, held until the test ends, so that a connection to it is
// refused and no other process can take it meanwhile.
func downState(t *testing.T) *runbookState {
	t.Helper()
	return &runbookState{subst: strings.NewReplacer("127.0.0.1:8080", testnet.Reserve(t).Addr())}
}

// runbookInChild are the sections whose state is a ledger that cannot be written: the child
// process of TestCheckpointFailureHoldsTheIncrement, under RLIMIT_FSIZE, runs them
// (runbookSectionNamed) while its checkpoints fail.
var runbookInChild = map[string]bool{"CfguardCheckpointFailing": true, "CfguardIngestStalled": true}

// run runs the commands of the single-node section s against st and checks their output.
func (st *runbookState) run(t *testing.T, s runbooktest.Section) {
	t.Helper()
	runbooktest.Run(t, s, runbookChecks[s.Name], st.subst, runbookNotRun)
}

// resetDaemon is a daemon whose input topic was deleted and recreated after it applied 64
// records, and that holds 96 new ones: ingest stopped (CfguardTopicReset).
func resetDaemon(t *testing.T) *runbookState {
	t.Helper()
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	records := func(prefix string, n int) [][]byte { return rowRecords(data, prefix, n) }
	r.Produce(t, records("old", 64)...)
	waitfor.Cond(t, 30*time.Second, "64 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 64 })
	kafkatest.RecreateTopic(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.Topic, 1)
	r.Produce(t, records("new", 96)...)
	waitResetReported(t, r, "ingest stopped for the reset")
	// The 96 records of the new log wait, although the ledger's offset (64) is below its end:
	// CfguardIngestStalled can fire beside CfguardTopicReset.
	waitfor.Cond(t, 30*time.Second, "cfguard_consumer_lag_records to count the new log's 96 records", func() bool {
		return r.Metric(t, "cfguard_consumer_lag_records") == 96
	})
	return &runbookState{r: r, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.D.cfg.StateDir),
	)}
}

// outboxDaemon is a daemon whose events topic was deleted before a drift changed the status of
// its CEs: status changes wait in the outbox and every publish attempt fails
// (CfguardOutboxBacklog).
func outboxDaemon(t *testing.T) *runbookState {
	t.Helper()
	r := startDaemon(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) })
	data := daemontest.Bundled(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(r.D.BrokerAddrs()...)}
	topic := r.D.cfg.Kafka.EventsTopic
	if res, err := cl.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}}); err != nil || res.Errors[topic] != nil {
		t.Fatalf("deleting %s: %v %v", topic, err, res)
	}
	daemontest.RegisterCEs(t, r, data, 4, "")
	r.Produce(t, daemontest.Flipped(data, 96)...)
	waitfor.Cond(t, 60*time.Second, "events waiting in the outbox after failed publish attempts", func() bool {
		return r.Metric(t, "cfguard_events_pending") > 0 && r.Metric(t, "cfguard_events_total", "result", "failed") > 0
	})
	return &runbookState{r: r, subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
	)}
}

// createTopic creates topic with one partition.
func createTopic(t *testing.T, brokers []string, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(brokers...)}
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[topic] != nil {
		t.Fatalf("creating %s: %v %v", topic, err, res)
	}
}
