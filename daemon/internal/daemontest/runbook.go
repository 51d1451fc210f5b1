package daemontest

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// RunbookPath is docs/RUNBOOK.md.
func RunbookPath(t testing.TB) string {
	return filepath.Join(tooltest.RepoRoot(t), "docs", "RUNBOOK.md")
}

var RunbookReplicaSections = map[string]string{
	"CfguardReplicationUnauthenticated": "daemon/internal/tests/replicalog TestForgedRecordsAreRefusedByEveryReplica, after forged records",
	"CfguardPosteriorLogRefused":        "daemon/internal/tests/replicalog TestForgedRecordsAreRefusedByEveryReplica, after signed entries every replica refuses",
	"CfguardPosteriorLogStopped":        "cmd/cfguard/internal/tests/replicalog TestNewEpochResumesStoppedReplicas, while the replicas are stopped",
	"CfguardPosteriorLogBehind":         "cmd/cfguard/internal/tests/replicalog TestFollowerBehindTheLog, while a follower's disk refuses its ledger's writes",
	"CfguardCounterfactualsNotCaughtUp": "daemon/internal/tests/owners TestRebuildThatCannotFetch, while the broker refuses the fetches of a partition being rebuilt",
	"CfguardReplicaSettingsDiffer":      "daemon/internal/tests/replicalog TestReplicaSettingsMustMatchTheGenesis, at a replica with another certify.delta",
}

// RunbookInChild are the sections whose state is a ledger that cannot be written: the child
// process of TestCheckpointFailureHoldsTheIncrement (daemon/internal/tests/writefail), under
// RLIMIT_FSIZE, runs them while its checkpoints fail.
var RunbookInChild = map[string]bool{"CfguardCheckpointFailing": true, "CfguardIngestStalled": true}

// RunbookOwnState are the sections whose state takes a daemon of its own, run by
// TestRunbookOfRenewalsBehindAndRecordsLost (daemon/internal/tests/runbook): confirmers held by a
// hook as a starved CPU holds them (CfguardRenewalBehind), and input records lost to retention
// (CfguardRecordsLost, whose state the tests of lost records share).
var RunbookOwnState = map[string]bool{"CfguardRenewalBehind": true, "CfguardRecordsLost": true}

// RunbookChecks: for every single-node alert, what each of its commands prints against a daemon
// in its state (TestRunbookCommandsRun's, or those RunbookOwnState and RunbookInChild name). A
// command the table does not know fails the test, so a new runbook command comes with its check.
var RunbookChecks = map[string][]runbooktest.Check{
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
		{Cmd: "--accept-topic-reset", Want: ""}, // starts a daemon: see RunbookNotRun
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

// RunbookNotRun are commands the runbook tests do not run, each with the test that covers it.
var RunbookNotRun = map[string]string{
	"--accept-topic-reset": "it starts a daemon that reads the reset topic from its start: TestRecreatedTopicStopsIngestUntilConfirmed restarts with the flag's option (Options.AcceptTopicReset)",
}

// RunbookState is a live daemon in the state of some alerts, and the substitutions that point a
// runbook command at it.
type RunbookState[S Server] struct {
	R     *Running[S]
	ID    string // a CE of the state's status, for ID
	Subst *strings.Replacer
}

// Run runs the commands of the single-node section s against st and checks their output.
func (st *RunbookState[S]) Run(t *testing.T, s runbooktest.Section) {
	t.Helper()
	runbooktest.Run(t, s, RunbookChecks[s.Name], st.Subst, RunbookNotRun)
}
