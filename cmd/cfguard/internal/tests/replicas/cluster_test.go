package replicas

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// readLog reads the whole posterior topic and replays it through an independent chain: it
// returns the accepted entries, the records not accepted, and the posterior of every version
// (the genesis body and the recorded last layers, each checked against its entry's hash).
func readLog(t *testing.T, brokers []string, keyFile string) (accepted, ignored []*postlog.Entry, posteriors map[uint64]*bnn.Model) {
	t.Helper()
	keys, err := clusterkey.Load(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	chain := postlog.NewChain(keys)
	posteriors = map[uint64]*bnn.Model{}
	var m *bnn.Model
	for _, msg := range kafkatest.ReadPartition(t, brokers, "cfguard.posterior", 0) {
		rec := postlog.Record{Offset: msg.Offset, Value: msg.Value}
		for _, h := range msg.Headers {
			if h.Key == clusterkey.Header {
				rec.Auth = h.Value
			}
		}
		e, reason, err := chain.Offer(rec)
		if err != nil {
			t.Fatal(err)
		}
		if reason != postlog.Accepted {
			if e != nil {
				ignored = append(ignored, e)
			}
			continue
		}
		if e.Kind == postlog.Genesis {
			if m, err = e.Body.Model(e.PosteriorSHA256); err != nil {
				t.Fatal(err)
			}
		} else if m, err = e.Apply(m); err != nil {
			t.Fatalf("entry %d: %v", e.Seq, err)
		}
		posteriors[m.Version] = m
		accepted = append(accepted, e)
	}
	return accepted, ignored, posteriors
}

// TestReplicasAsProcesses runs three replicas as processes against a three-node broker process
// while records stream, through the faults a Deployment meets: SIGKILL and SIGSTOP of the
// updater, a rolling restart, a wiped replica and a restored backup. After each, every replica
// applies the same entries to the same posterior bit for bit, and at the end the log covers every
// record produced exactly once.
func TestReplicasAsProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("three replica processes through faults: not with -short")
	}
	root := t.TempDir()
	data, model, modelDir := proc.TrainModel(t, root)
	brokers := proc.StartClusterBroker(t)
	reps := proc.StartReplicas(t, root, 3, brokers, modelDir)
	ces := registerRoundRobin(t, reps, data, model, 12)
	s := proc.StartStream(brokers, data)
	defer func() {
		select {
		case <-s.Done:
		default:
			s.End(t)
		}
	}()
	waitfor.Cond(t, 60*time.Second, "records applied", func() bool { v, ok := reps[0].View(); return ok && v.Version >= 3 })
	v := proc.WaitAgree(t, "streaming", reps, -1)
	others := func(r *proc.ReplicaProc) []*proc.ReplicaProc {
		return slices.DeleteFunc(slices.Clone(reps), func(o *proc.ReplicaProc) bool { return o == r })
	}

	// SIGKILL of the updater: another replica claims the next term once the group's session
	// expires, and goes on from the log's head.
	u := proc.UpdaterOf(t, reps, 0, 30*time.Second)
	killed := time.Now()
	u.Kill(t)
	// Meanwhile the others predict, under the last version each applied (a session's wait).
	during := 0
	for _, r := range others(u) {
		before := r.WaitView(t)
		got := r.Predict(t, data.X[0])
		after := r.WaitView(t)
		if got < before.Version || got > after.Version {
			t.Errorf("%s predicted under posterior version %d after the updater's SIGKILL, between views of versions %d and %d", r.ID, got, before.Version, after.Version)
		}
		if after.Replication.Term == v.Replication.Term {
			during++
		}
	}
	t.Logf("%d of %d predictions after the updater's SIGKILL answered before another replica claimed its term", during, len(reps)-1)
	next := proc.UpdaterOf(t, others(u), v.Replication.Term, 3*proc.ReplicaSession+10*time.Second)
	t.Logf("takeover after SIGKILL of %s: %s became updater in %v (session timeout %v)", u.ID, next.ID, time.Since(killed).Round(time.Millisecond), proc.ReplicaSession)
	u.Start(t)
	v = proc.WaitAgree(t, "after SIGKILL", reps, -1)

	// SIGSTOP of the updater past its session: another takes over; SIGCONT: the resumed one's
	// term is over, and whatever it appends is ignored by every replica (no fork).
	u = proc.UpdaterOf(t, reps, 0, 30*time.Second)
	stoppedTerm := v.Replication.Term
	if uv, ok := u.View(); ok {
		stoppedTerm = uv.Replication.Term
	}
	paused := time.Now()
	u.Signal(t, syscall.SIGSTOP)
	next = proc.UpdaterOf(t, others(u), stoppedTerm, 3*proc.ReplicaSession+10*time.Second)
	t.Logf("takeover after SIGSTOP of %s: %s became updater in %v", u.ID, next.ID, time.Since(paused).Round(time.Millisecond))
	waitfor.Cond(t, 30*time.Second, "entries of the new term", func() bool {
		nv, ok := next.View()
		return ok && nv.Replication.Entry > v.Replication.Entry+2
	})
	u.Signal(t, syscall.SIGCONT)
	v = proc.WaitAgree(t, "after SIGSTOP and SIGCONT", reps, -1)

	// A rolling restart while records stream.
	for _, r := range reps {
		r.Terminate(t)
		r.Start(t)
	}
	v = proc.WaitAgree(t, "after a rolling restart", reps, -1)

	// A replica wiped and restarted rebuilds from Kafka.
	wiped := reps[2]
	wiped.Terminate(t)
	if err := os.RemoveAll(filepath.Join(wiped.Dir, "state")); err != nil {
		t.Fatal(err)
	}
	wiped.Start(t)
	v = proc.WaitAgree(t, "after a wiped replica rebuilt", reps, -1)

	// A backup restored while records stream: the restored replica replays the log's entries
	// after its backup's head, to the same posteriors.
	restored := reps[1]
	backup := filepath.Join(root, "r2.backup")
	var out, errOut bytes.Buffer
	if code := command.Run(context.Background(), []string{"backup", "--config", restored.Config, "--out", backup, "--url", "http://" + restored.Child.Addr()}, &out, &errOut); code != 0 {
		t.Fatalf("cfguard backup: %d: %s", code, errOut.String())
	}
	waitfor.Cond(t, 30*time.Second, "entries after the backup", func() bool {
		nv, ok := reps[0].View()
		return ok && nv.Replication.Entry > v.Replication.Entry+3
	})
	restored.Terminate(t)
	if err := os.Rename(filepath.Join(restored.Dir, "state"), filepath.Join(restored.Dir, "state.aside")); err != nil {
		t.Fatal(err)
	}
	if code := command.Run(context.Background(), []string{"restore", "--config", restored.Config, "--from", backup}, io.Discard, &errOut); code != 0 {
		t.Fatalf("cfguard restore: %d: %s", code, errOut.String())
	}
	restored.Start(t)

	produced := s.End(t)
	v = proc.WaitAgree(t, "at the end", reps, produced)

	// Every CE reads the same at every replica after the faults: held by one owner, found by
	// all (its owner may still be confirming the last versions: the answers settle).
	for _, id := range ces {
		sameEverywhere(t, reps, id)
	}

	// Coverage: every record produced was applied or dead-lettered, once.
	for _, r := range reps {
		rv, _ := r.View()
		if rv.Replication.Stopped != "" {
			t.Errorf("%s stopped following: %s", r.ID, rv.Replication.Stopped)
		}
	}
	accepted, ignored, _ := readLog(t, brokers, proc.ClusterKey(t, root))
	var applied, dead int64
	claims := map[uint64]string{}
	for _, e := range accepted {
		if e.Counts != nil {
			applied += e.Counts.Applied
			dead += e.Counts.DeadLettered
		}
		switch e.Kind {
		case postlog.Claim:
			if _, dup := claims[e.Term]; dup {
				t.Errorf("two accepted claims of term %d", e.Term)
			}
			claims[e.Term] = e.Writer
		case postlog.Increment:
			if claims[e.Term] != e.Writer {
				t.Errorf("entry %d of term %d written by %s, the term's claimant is %s", e.Seq, e.Term, e.Writer, claims[e.Term])
			}
		}
	}
	if applied+dead != int64(produced) || dead != int64(produced/40) {
		t.Errorf("the log applies %d and dead-letters %d records, want %d in all with %d dead letters", applied, dead, produced, produced/40)
	}
	last := accepted[len(accepted)-1]
	if last.PosteriorSHA256 != v.Replication.SHA || last.Seq != v.Replication.Entry {
		t.Errorf("an independent replay of the log ends at entry %d, posterior %s; the replicas are at %d, %s", last.Seq, last.PosteriorSHA256, v.Replication.Entry, v.Replication.SHA)
	}
	// The replicas' KL histories (version and KL of each update) are the same record for record.
	h0 := reps[0].WaitView(t)
	for _, r := range reps[1:] {
		rv := r.WaitView(t)
		if !slices.EqualFunc(h0.KLHistory, rv.KLHistory, func(a, b json.RawMessage) bool { return klKey(a) == klKey(b) }) {
			t.Errorf("%s's KL history differs from %s's", r.ID, reps[0].ID)
		}
	}
	t.Logf("%d records produced, %d applied, %d dead-lettered; %d entries accepted over %d terms, %d records ignored; posterior version %d (%s)",
		produced, applied, dead, len(accepted), len(claims), len(ignored), v.Version, v.Replication.SHA[:12])
	// Every increment re-executes from the input records it covers to its entry's bits.
	proc.VerifyLog(t, reps[0].Config, len(accepted)-len(claims)-1)

	// The first claim, SIGKILL, SIGSTOP and the updater's turn in the rolling restart each open a term.
	if len(claims) < 4 {
		t.Errorf("%d terms: the faults should have made at least 4", len(claims))
	}
}

// klKey is what an entry of the KL history says of the update (the version, its KL and
// outcome); the time and the anchors' KL are the replica's own.
func klKey(raw json.RawMessage) string {
	var e struct {
		Version uint64  `json:"posterior_version"`
		KL      float64 `json:"kl"`
		Outcome string  `json:"outcome"`
	}
	if json.Unmarshal(raw, &e) != nil {
		return string(raw)
	}
	return fmt.Sprintf("%d %x %s", e.Version, e.KL, e.Outcome)
}

// registerRoundRobin registers n CEs (ce-0, ce-1, ...) at the replicas in turn and returns their ids.
func registerRoundRobin(t *testing.T, reps []*proc.ReplicaProc, data *dataset.Set, model *bnn.Model, n int) []string {
	t.Helper()
	xs, cfs := proc.CandidatePairs(t, model, data, 400, 0.985, 0.002, true)
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	var ids []string
	for k := range n {
		id := fmt.Sprintf("ce-%d", k)
		body, _ := json.Marshal(map[string]any{"id": id, "x": data.X[xs[k]], "x_cf": data.X[cfs[k]], "target": "benign"})
		r := reps[k%len(reps)]
		resp, err := http.Post("http://"+r.Child.Addr()+"/v1/counterfactuals", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("register %s at %s: %d %s", id, r.ID, resp.StatusCode, b)
		}
		ids = append(ids, id)
	}
	return ids
}

// sameEverywhere waits until every replica answers GET /v1/counterfactuals/{id} with 200 and
// the same bytes in one pass, and returns them.
func sameEverywhere(t *testing.T, reps []*proc.ReplicaProc, id string) []byte {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var first []byte
		last := ""
		for _, r := range reps {
			code, b := r.GetCE(id)
			switch {
			case code != http.StatusOK:
				last = fmt.Sprintf("%s answers %d %s", r.ID, code, b)
			case first == nil:
				first = b
			case !bytes.Equal(first, b):
				last = fmt.Sprintf("%s answers\n%s\n%s answered\n%s", r.ID, b, reps[0].ID, first)
			}
			if last != "" {
				break
			}
		}
		if last == "" {
			return first
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s does not read the same at every replica within 30 s: %s", id, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestReplicaOwnerKilledDuringDrift registers CEs round-robin at three replicas, streams records
// that teach the model the opposite labels, and SIGKILLs one replica mid-drift. Its CE
// partitions move; afterwards every CE is readable at every replica with one answer, its bound
// is Theorem 1 recomputed from the posterior log (the anchor it was measured under against the
// last posterior), and its status is the one the newest status change on the events topic
// names.
func TestReplicaOwnerKilledDuringDrift(t *testing.T) {
	if testing.Short() {
		t.Skip("three replica processes and a drift: not with -short")
	}
	root := t.TempDir()
	data, model, modelDir := proc.TrainModel(t, root)
	brokers := proc.StartClusterBroker(t)
	reps := proc.StartReplicas(t, root, 3, brokers, modelDir, paperLearner)

	const n = 24
	registerRoundRobin(t, reps, data, model, n)
	s := proc.StartStreamFlip(brokers, data, true, proc.StreamEvery)
	defer func() {
		select {
		case <-s.Done:
		default:
			s.End(t)
		}
	}()
	waitfor.Cond(t, 60*time.Second, "the drift under way", func() bool { v, ok := reps[0].View(); return ok && v.Version >= 5 })
	victim := reps[1]
	killed := time.Now()
	victim.Kill(t)
	live := []*proc.ReplicaProc{reps[0], reps[2]}
	// Until the killed owner's partitions have another owner, a read of its CEs says when to
	// retry: 502 naming it while the group waits out its session, 503 while the next owner
	// rebuilds them.
	unanswered := map[int]int{}
	waitfor.Cond(t, 3*proc.ReplicaSession+20*time.Second, "every CE readable at the live replicas", func() bool {
		for _, r := range live {
			for k := range n {
				code, b, retry := r.GetCEAnswer(fmt.Sprintf("ce-%d", k))
				if code == http.StatusOK {
					continue
				}
				unanswered[code]++
				switch {
				case code != http.StatusBadGateway && code != http.StatusServiceUnavailable:
					t.Fatalf("ce-%d at %s after %s's SIGKILL: %d %s, want 502 or 503 until its partitions move", k, r.ID, victim.ID, code, b)
				case retry == "":
					t.Fatalf("ce-%d at %s after %s's SIGKILL: %d without Retry-After: %s", k, r.ID, victim.ID, code, b)
				case code == http.StatusBadGateway && !bytes.Contains(b, []byte(victim.ID)):
					t.Fatalf("ce-%d at %s after %s's SIGKILL: 502 not naming it: %s", k, r.ID, victim.ID, b)
				}
				return false
			}
		}
		return true
	})
	t.Logf("the killed owner's CEs answered again after %v (answers before, by code: %v)", time.Since(killed).Round(time.Millisecond), unanswered)
	// Each CE keeps what the dead owner last wrote of it on the CE state topic: its anchor is that
	// state's or a renewal's since, and its history holds that state's.
	written := lastStatesOf(t, brokers, victim.ID)
	if len(written) == 0 {
		t.Fatalf("%s wrote no CE state before its SIGKILL", victim.ID)
	}
	entries := 0
	for id, was := range written {
		entries += len(was.History)
		code, b := live[0].GetCE(id)
		var now ceState
		if code != http.StatusOK || json.Unmarshal(b, &now) != nil {
			t.Fatalf("GET %s after the move: %d %s", id, code, b)
		}
		if now.AnchorVersion < was.AnchorVersion {
			t.Errorf("%s: anchored to version %d after the move; %s's last state of it was anchored to %d", id, now.AnchorVersion, victim.ID, was.AnchorVersion)
		}
		for _, h := range was.History {
			if !slices.Contains(now.History, h) {
				t.Errorf("%s: its history after the move lacks %+v of %s's last state", id, h, victim.ID)
			}
		}
	}
	t.Logf("%d CEs whose last state %s wrote holds %d history entries: each kept them when it moved", len(written), victim.ID, entries)
	victim.Start(t)
	produced := s.End(t)
	v := proc.WaitAgree(t, "after the drift", reps, produced)
	// The restarted victim's ledger still held the partitions that moved: it releases those it
	// is not given back, so that each CE is in one ledger (one replica re-certifies, confirms
	// and audits it).
	waitfor.Cond(t, 60*time.Second, "each CE in one replica's ledger", func() bool {
		sum := 0
		for _, r := range reps {
			k := r.Stored()
			if k < 0 {
				return false
			}
			sum += k
		}
		return sum == n
	})
	// Let the owners confirm what the drift made lapse, then read every CE at every replica.
	waitfor.Cond(t, 60*time.Second, "no renewal pending", func() bool {
		for k := range n {
			code, b := reps[0].GetCE(fmt.Sprintf("ce-%d", k))
			if code != http.StatusOK || bytes.Contains(b, []byte(`"renewal_pending":true`)) {
				return false
			}
		}
		return true
	})
	_, _, posteriors := readLog(t, brokers, proc.ClusterKey(t, root))
	last := posteriors[v.Version]
	events := readEvents(t, brokers)
	statuses := map[string]int{}
	for k := range n {
		id := fmt.Sprintf("ce-%d", k)
		first := sameEverywhere(t, reps, id)
		var ce struct {
			Status        string  `json:"status"`
			AnchorVersion uint64  `json:"anchor_version"`
			P1            float64 `json:"p1"`
			Var1          float64 `json:"var1"`
			Samples       int     `json:"samples"`
			Delta         float64 `json:"delta"`
			Epsilon       float64 `json:"epsilon"`
			Bound         float64 `json:"bound"`
			KL            float64 `json:"kl_from_anchor"`
		}
		if err := json.Unmarshal(first, &ce); err != nil {
			t.Fatal(err)
		}
		statuses[ce.Status]++
		if ce.Status != "uncertified" {
			anchor, ok := posteriors[ce.AnchorVersion]
			if !ok {
				t.Fatalf("%s is anchored to version %d, which the log does not hold", id, ce.AnchorVersion)
			}
			kl, _, err := certify.KL(last, anchor)
			if err != nil {
				t.Fatal(err)
			}
			b := certify.DefaultPolicy().Bounds(certify.Certificate{P1: ce.P1, Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon}, kl)
			if ce.KL != kl || ce.Bound != b.ProbLower {
				t.Errorf("%s: KL %v and bound %v at its owner; from the log, KL(q%d || q%d) = %v and bound %v", id, ce.KL, ce.Bound, v.Version, ce.AnchorVersion, kl, b.ProbLower)
			}
		}
		if got, ok := events[id]; ce.Status != "certified" && (!ok || got.To != ce.Status) {
			t.Errorf("%s is %s; the newest status change on the events topic says %+v (found: %v)", id, ce.Status, got, ok)
		}
	}
	t.Logf("after the drift (%d records, posterior version %d): %v", produced, v.Version, statuses)
	proc.VerifyLog(t, reps[0].Config, -1)
	if statuses["certified"] == n {
		t.Error("the drift changed no status: the test tests nothing")
	}
}

// ceState is what TestReplicaOwnerKilledDuringDrift compares of a CE before and after it moved:
// its anchor and its history, as GET /v1/counterfactuals/{id} and the CE state topic hold them.
type ceState struct {
	AnchorVersion uint64 `json:"anchor_version"`
	History       []struct {
		At, From, To     string
		PosteriorVersion uint64 `json:"posterior_version"`
		Renewal          bool   `json:"renewal"`
	} `json:"history"`
}

// lastStatesOf reads the CE state topic (every partition of the default cfguard.ce.state) to
// its end and returns, per CE, the last state replica wrote of it (tombstones end a CE's).
func lastStatesOf(t *testing.T, brokers []string, replica string) map[string]ceState {
	t.Helper()
	out := map[string]ceState{}
	for p := range 12 { // replication.ce_partitions' default
		for _, msg := range kafkatest.ReadPartition(t, brokers, "cfguard.ce.state", p) {
			if msg.Value == nil {
				delete(out, string(msg.Key))
				continue
			}
			var st struct {
				ID      string   `json:"id"`
				Replica string   `json:"replica"`
				CE      *ceState `json:"ce"`
			}
			if err := json.Unmarshal(msg.Value, &st); err != nil || st.ID != string(msg.Key) || st.CE == nil {
				continue // a claim of the partition
			}
			if st.Replica == replica {
				out[st.ID] = *st.CE
			}
		}
	}
	return out
}

// statusEvent is a status change on the events topic.
type statusEvent struct {
	Type             string `json:"type"`
	ID               string `json:"id"`
	From, To         string
	PosteriorVersion uint64 `json:"posterior_version"`
}

// readEvents reads the events topic to its end and returns, per CE, the status change of the
// newest posterior version (the last published among equals).
func readEvents(t *testing.T, brokers []string) map[string]statusEvent {
	t.Helper()
	out := map[string]statusEvent{}
	for p := 0; p < 3; p++ {
		for _, msg := range kafkatest.ReadPartition(t, brokers, "cfguard.events", p) {
			var e statusEvent
			if json.Unmarshal(msg.Value, &e) != nil || e.Type != "status_changed" {
				continue
			}
			if old, ok := out[e.ID]; !ok || e.PosteriorVersion >= old.PosteriorVersion {
				out[e.ID] = e
			}
		}
	}
	return out
}
