package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/replica"
)

// share is a replica's part in the CEs (package ceshare, docs/DESIGN.md): registrations and
// deletions accepted by any replica are requests on the CE topic, keyed by CE id; the replica
// that the group <kafka.group_id>.ce gives a partition keeps that partition's CEs in its
// ledger, re-certifies them at every entry of the posterior log, confirms, renews and audits
// them, and publishes their status changes. Reads of a CE another replica owns are forwarded
// to it.
type share struct {
	d          *Daemon
	id         string // replication.replica_id (or the host name)
	partitions int
	prod       *ceshare.Producer
	member     *ceshare.Member
	dir        *ceshare.Directory
	client     *http.Client  // questions to peers: reads, lists, outcomes (peerTimeout)
	wait       time.Duration // how long a request waits for its owner's outcome: replication.register_wait
	// auditClient forwards POST /v1/audit, which takes as long as the peer's share needs
	// (minutes at 10^6 CEs): bounded by the caller's context only.
	auditClient *http.Client
	lg          *slog.Logger
	stopping    context.Context // run's: ended once the replica stops
	applied     broadcast       // signalled after each Apply: outcomes waited for may be stored
}

// broadcast wakes every waiter at once: wait returns a channel that the next signal closes.
type broadcast struct {
	mu sync.Mutex
	ch chan struct{}
}

func (b *broadcast) wait() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ch == nil {
		b.ch = make(chan struct{})
	}
	return b.ch
}

func (b *broadcast) signal() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ch != nil {
		close(b.ch)
		b.ch = nil
	}
}

// awaitOwner bounds how long an owner's batch of requests waits for a posterior version it has
// not applied yet (awaitVersion). How long a request waits for its owner before it is answered
// 202 is replication.register_wait (share.wait).
const awaitOwner = 10 * time.Second

// peerTimeout bounds a question to another replica (a read, a page, an outcome, an audit's
// status), from the request to the end of its answer.
const peerTimeout = 10 * time.Second

// auditRebuildWait bounds how long an audit waits for this replica's partitions to be rebuilt
// before it measures them (a rebuild of 10^6 CEs took 50 s: BENCHMARKS.md, Replicas).
const auditRebuildWait = 2 * time.Minute

// outcomeHold bounds how long an owner holds another replica's question for a request's
// outcome (share.outcome) before it answers what it has; outcomeGap is the least time between
// two questions of one waiting request.
const (
	outcomeHold = 2 * time.Second
	outcomeGap  = 20 * time.Millisecond
)

// sendTimeout bounds how long one registration or deletion request is retried against the CE
// topic (a partition electing a leader answers within it); a batch whose request times out
// sends none of its later requests. Past it the request is
// answered 503 with Retry-After: the topic is gone or unreachable, and a client waiting for ever
// would not know.
const sendTimeout = 10 * time.Second

// advertiseURL is replication.advertise_url, or the API's bound address when http.listen names
// a host, or <host name>:<port> when it listens on every interface; the scheme is https when
// the API serves TLS (http.web_config_file), else http.
func advertiseURL(configured string, bound net.Addr, tls bool) (string, error) {
	if configured != "" {
		return configured, nil
	}
	host, port, err := net.SplitHostPort(bound.String())
	if err != nil {
		return "", err
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		if host, err = os.Hostname(); err != nil {
			return "", fmt.Errorf("replication.advertise_url is empty, http.listen listens on every interface and the host name cannot be read (%w): set replication.advertise_url", err)
		}
	}
	scheme := "http://"
	if tls {
		scheme = "https://"
	}
	return scheme + net.JoinHostPort(host, port), nil
}

// newShare joins the CE topic: a producer for requests, a member of the CE group (run by
// share.run) and a directory of owners.
func newShare(ctx context.Context, d *Daemon, replicaID string) (*share, error) {
	rc := d.cfg.Replication
	adv, err := advertiseURL(rc.AdvertiseURL, d.httpAddr, d.cfg.ServesTLS())
	if err != nil {
		return nil, err
	}
	tr, err := replica.PeerTransport(rc)
	if err != nil {
		return nil, err
	}
	s := &share{d: d, id: replicaID, partitions: rc.CEPartitions, client: &http.Client{Timeout: peerTimeout, Transport: tr}, wait: rc.RegisterWait,
		auditClient: &http.Client{Transport: tr}, lg: d.log.With("component", "ceshare")}
	group := d.cfg.Kafka.GroupID + ".ce"
	held, err := d.ledger.ShareOffsets()
	if err != nil {
		return nil, err
	}
	m := d.rep.Metrics()
	if s.member, err = ceshare.NewMember(ctx, ceshare.MemberConfig{Conn: d.conn, Topic: rc.CETopic, Group: group, Partitions: rc.CEPartitions,
		StateTopic: ceshare.StateTopic(rc.CETopic), ReplicaID: replicaID, AdvertiseURL: adv, Held: slices.Sorted(maps.Keys(held)),
		SessionTimeout: rc.SessionTimeout, HeartbeatInterval: rc.HeartbeatInterval, Keys: d.rep.Keys(),
		OnUnauthenticated: func(topic string, _ int, _ int64) { m.Unauthenticated.WithLabelValues(topic).Inc() },
		OnMalformedState:  func(int, int64) { m.CEStates.WithLabelValues(alerts.StateInvalid).Inc() },
		OnFencedState:     func(int, int64) { m.CEStates.WithLabelValues(alerts.StateFenced).Inc() },
		OnGeneration:      d.hooks.ceGeneration}, s, s.lg); err != nil {
		return nil, err
	}
	d.states.member.Store(s.member)
	m.SetRebuilding(func() int { return len(s.notCaughtUp()) })
	if s.prod, err = ceshare.NewProducer(ctx, d.conn, rc.CETopic, d.rep.Keys(), s.lg); err != nil {
		return nil, err
	}
	if s.dir, err = ceshare.NewDirectory(ctx, d.conn, group, rc.CETopic, rc.CEPartitions, s.lg); err != nil {
		s.prod.Close()
		return nil, err
	}
	s.lg.Info("sharing the CEs", "topic", rc.CETopic, "partitions", rc.CEPartitions, "group", group, "advertise_url", adv)
	return s, nil
}

func (s *share) close() error { return errors.Join(s.prod.Close(), s.dir.Close()) }

// health is the share's part of /readyz: not before the CE group gave this replica its share
// (a replica restarted after a crash owns nothing until the group's session of its previous run
// expires), nor while a partition it owns is being restored. Nil before Run set the share.
func (s *share) health() error {
	if s == nil {
		return nil
	}
	if s.member.Stats().Generations == 0 {
		return fmt.Errorf("joining the CE group of %s", s.d.cfg.Replication.CETopic)
	}
	// Assigned too: a partition of a new generation is assigned before it is acquired.
	return s.rebuilding()
}

// run is the member of the CE group until ctx ends, once no other member carries this
// replica's id (uniqueID).
func (s *share) run(ctx context.Context) error {
	s.stopping = ctx
	if err := s.uniqueID(ctx, 2*s.d.cfg.Replication.SessionTimeout+5*time.Second); err != nil {
		return err
	}
	return s.member.Run(ctx)
}

// uniqueID waits until no member of the CE group carries this replica's id, and fails when one
// still does after wait: two replicas with one replication.replica_id would each take the
// other's partitions for their own and answer 404 for CEs the other stores. A previous process
// of this replica that did not leave the group (killed) is gone once its session expires, within
// replication.session_timeout; a replica configured with the same id stays.
func (s *share) uniqueID(ctx context.Context, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	logged := false
	for {
		members, err := s.dir.Members(ctx)
		var twin *ceshare.Owner
		for i, m := range members {
			if m.Replica == s.id {
				twin = &members[i]
			}
		}
		switch {
		case err == nil && twin == nil:
			return nil
		case err == nil && time.Now().After(deadline):
			return fmt.Errorf("replication.replica_id %q is the id of another live member of the CE group %s (member %s, advertising %s), "+
				"still there after %s: give each replica its own replication.replica_id", s.id, s.d.cfg.Kafka.GroupID+".ce", twin.MemberID,
				twin.URL, wait)
		case err == nil && !logged:
			logged = true
			s.lg.Warn("another member of the CE group has this replica's id: waiting for it to leave (a previous process of this "+
				"replica whose session has not expired) before joining", "replica_id", s.id, "member", twin.MemberID, "url", twin.URL, "at_most", wait)
		case err != nil && time.Now().After(deadline):
			s.lg.Warn("joining the CE group without knowing whether another member has this replica's id: the group cannot be described",
				"replica_id", s.id, "err", err)
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// Acquire is ceshare.Hooks: partition p is read from the offset the ledger applied. The member
// has released (Release) the partitions the ledger still holds from before a restart and that
// the group gave to others before it acquires any: this replica must not confirm, audit or
// publish for CEs it does not own.
func (s *share) Acquire(ctx context.Context, p int) (int64, error) {
	off, ok, err := s.d.ledger.ShareOffset(p)
	if err != nil {
		return 0, err
	}
	s.d.rep.Metrics().CEPartitions.Set(float64(len(s.member.Owned())))
	s.lg.Info("CE partition acquired", "partition", p, "from", off, "held_before", ok)
	return off, nil
}

// Release is ceshare.Hooks: partition p's CEs leave this ledger (their new owner rebuilds them
// from the CE topic). A release cut short leaves p's offset at 0 (ledger.ReleaseShare), and a
// restart that is not given p back releases it again (MemberConfig.Held).
func (s *share) Release(ctx context.Context, p int) error {
	if s.stopping != nil && s.stopping.Err() != nil {
		// The replica stops: its ledger keeps the partition, and a restart that gets it back
		// resumes from there instead of the CE topic's start.
		return nil
	}
	n, err := s.d.ledger.ReleaseShare(ctx, p, func(id string) bool { return ceshare.Partition(id, s.partitions) == p })
	if err != nil {
		return err
	}
	s.d.rep.Metrics().CEPartitions.Set(float64(len(s.member.Owned())))
	s.lg.Info("CE partition released", "partition", p, "counterfactuals", n)
	return nil
}

// Lost is ceshare.Hooks: the requests of partition p from `from` to `to` were deleted from the
// CE topic before this replica read them. The ledger moves p's offset past them and counts them
// (cfguard_records_lost_total for the CE topic, CfguardRecordsLost) in one transaction; the CEs
// they registered are not in this share (but for those restored from their states before the
// gap: ceshare.Request.Restored), and those they deleted stay. A ledger that cannot be
// written is retried as every share write is (durably).
func (s *share) Lost(ctx context.Context, p int, from, to int64) error {
	return s.d.durably(ctx, func() error { return s.d.ledger.SkipShare(p, from, to) })
}

// Reset is ceshare.Hooks: partition p of the CE topic ends at end, before what this ledger read
// (the topic was deleted and created again), so the requests that registered p's CEs are gone.
// The partition's offset goes back to 0 first (a crash after it leaves the CEs in this ledger
// and no request of the new log skipped), then every CE of p this ledger holds is sent again
// as a registration with its anchor and certificate: reading p from 0, this replica applies them
// as already stored, and a later owner of p stores them from the topic.
// cfguard_counterfactuals_repaired_total counts them; one that cannot be sent stays in this
// ledger only (an ERROR line says how many).
func (s *share) Reset(ctx context.Context, p int, end int64) error {
	if _, err := s.d.ledger.ApplyShare(p, nil, 0, nil); err != nil {
		return err
	}
	var ces []*ledger.CE
	for after := ""; ; {
		page, err := s.d.ledger.List(0, 1000, after)
		if err != nil {
			return err
		}
		for _, ce := range page {
			if ceshare.Partition(ce.ID, s.partitions) == p {
				ces = append(ces, ce)
			}
		}
		if len(page) < 1000 {
			break
		}
		after = page[len(page)-1].ID
	}
	sent, failed := 0, 0
	for len(ces) > 0 {
		batch := ces[:min(len(ces), 256)]
		ces = ces[len(batch):]
		errs, _ := s.send(ctx, batch, make([]ledger.RequestRef, len(batch)))
		for _, err := range errs {
			if err != nil {
				failed++
			} else {
				sent++
			}
		}
	}
	s.d.rep.Metrics().CERepaired.Add(float64(sent))
	if failed > 0 {
		s.lg.Error("CE partition reset: counterfactuals of this ledger could not be sent to the CE topic again; they stay in this "+
			"ledger only, and a move of the partition loses them", "partition", p, "sent", sent, "not_sent", failed)
		return nil
	}
	s.lg.Warn("CE partition reset: this ledger's counterfactuals of the partition sent to the CE topic again", "partition", p,
		"counterfactuals", sent, "topic_end", end)
	return nil
}

// Apply is ceshare.Hooks: registrations and deletions of partition p, in order, and the offset
// after them, in one ledger transaction (ledger.ApplyShare): a crash leaves all of them applied
// with the offset after them, or none with the offset before them, so that the member reads
// them again. A request applied before (its request id has an outcome: a producer's retry, a
// client's retry with its Idempotency-Key) is not applied again; a registration of a stored id
// and a deletion of a missing one change nothing. Each request's outcome, stored under its id,
// is what the replica that accepted it answers (share.await). A registration rebuilt from a CE
// state at a gap of deleted requests (ceshare.Request.Restored) is stored from its state
// (restoredOp), with no outcome, and p's offset stays at next.
//
// Each registration is anchored to the posterior it was measured under: the current one, a
// live anchor, or a past version taken from the posterior log (replica.Replica.Past). A CE measured
// under a version this replica has not applied yet waits for it (at most awaitOwner), and so does
// the state its previous owner left of it (up to its verdict's and history's versions, which
// checkState wants applied; a replica that joined while its follower still plays the log gets
// there within the wait): a CE whose version it still lacks then is measured again under the
// current posterior, as a registration here would be, and a state past it is not used.
func (s *share) Apply(ctx context.Context, p int, reqs []ceshare.Request, next int64) error {
	ops := make([]ledger.ShareOp, len(reqs))
	newest := uint64(0)
	for i, r := range reqs {
		if r.Restored {
			if ops[i] = s.restoredOp(p, r); ops[i].State != nil {
				newest = max(newest, ops[i].State.NewestVersion())
			}
			continue
		}
		ops[i] = ledger.ShareOp{RID: r.RID, Fingerprint: r.Fingerprint, Offset: r.Offset, ID: r.ID}
		if r.Kind != ceshare.KindRegister {
			continue
		}
		var ce measured
		if err := json.Unmarshal(r.CE, &ce); err != nil {
			s.lg.Error("CE registration refused: its CE does not decode", "partition", p, "offset", r.Offset, "id", r.ID, "err", err)
			ops[i].Refuse = "the registration's CE does not decode: " + err.Error()
			continue
		}
		// What the owner's ledger judges is its own to fill in.
		ops[i].CE = &ledger.CE{ID: r.ID, X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: ce.AnchorVersion,
			P1: ce.P1, Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon, CreatedAt: r.At}
		newest = max(newest, ce.AnchorVersion)
		if r.State != nil {
			if ops[i].State = s.stateOf(p, r); ops[i].State != nil {
				newest = max(newest, ops[i].State.NewestVersion())
			}
		}
	}
	if s.d.hooks.shareAwait != nil {
		s.d.hooks.shareAwait(newest)
	}
	s.awaitVersion(ctx, newest)
	outs, err := s.applyOps(ctx, p, ops, next)
	if err != nil {
		return err
	}
	applied := 0 // requests, not registrations rebuilt from states
	for i, o := range outs {
		s.noteOutcome(p, reqs[i], o)
		if !reqs[i].Restored {
			applied++
		}
	}
	s.d.rep.Metrics().CEApplied.Add(float64(applied))
	s.d.confirm.notify()
	s.applied.signal()
	return nil
}

// noteOutcome counts and logs what became of request r of partition p (o): a duplicate, a
// refusal, a state used or not.
func (s *share) noteOutcome(p int, r ceshare.Request, o ledger.Outcome) {
	if o.Duplicate {
		s.d.requests.Skipped(r.Kind, 1)
	}
	switch {
	case o.Result == ledger.OutcomeRefused && r.Restored:
		s.lg.Error("CE not restored from its state: the ledger refused it", "partition", p, "id", o.ID, "detail", o.Detail)
	case o.Result == ledger.OutcomeExists && r.Restored:
		s.lg.Warn("CE not restored from its state: its id holds another CE", "partition", p, "id", o.ID, "detail", o.Detail)
	case o.Result == ledger.OutcomeRefused && !o.Duplicate:
		s.lg.Error("CE registration refused by the ledger", "partition", p, "offset", r.Offset, "id", o.ID, "detail", o.Detail)
	}
	switch {
	case o.State == ledger.StateRestored:
		s.d.rep.Metrics().CEStates.WithLabelValues(alerts.StateRestored).Inc()
	case o.State != "" && r.Restored:
		s.d.rep.Metrics().CEStates.WithLabelValues(alerts.StateNotUsed).Inc()
		s.lg.Warn("CE restored without its state's renewals, verdict and history", "partition", p, "id", o.ID, "why", o.State)
	case o.State != "":
		s.d.rep.Metrics().CEStates.WithLabelValues(alerts.StateNotUsed).Inc()
		s.lg.Warn("CE stored from its registration", "partition", p, "id", o.ID, "why", o.State)
	}
}

// applyOps is ledger.ApplyShare under d.mu (no posterior is committed between the ledger's
// judgement and its write), with the past posteriors its registrations need: first with those
// the batch names (pastVersions), then with any others the ledger still asks for that the
// posterior log has, then with the registrations still lacking theirs measured again under the
// current posterior.
func (s *share) applyOps(ctx context.Context, p int, ops []ledger.ShareOp, next int64) ([]ledger.Outcome, error) {
	d := s.d
	var outs []ledger.Outcome
	anchors, err := d.ledger.Anchors()
	if err != nil {
		return nil, err
	}
	live := map[uint64]bool{}
	for _, a := range anchors {
		live[a.Version] = true
	}
	stored := func(id string) bool { // a request replayed after a restart, applied before
		_, err := d.ledger.Get(id)
		return !errors.Is(err, ledger.ErrNotFound)
	}
	// Asked for at once, so that one play of the log finds them all (replica.Replica.Past).
	past, err := d.rep.Past(ctx, pastVersions(ops, d.current().Version, live, stored))
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		s.lg.Warn("past posteriors not found in the posterior log: restored verdicts are measured again", "partition", p, "err", err)
		past = nil
	}
	for attempt := 0; ; attempt++ {
		var need *ledger.AnchorsNeededError
		err := d.durably(ctx, func() error {
			d.mu.Lock()
			defer d.mu.Unlock()
			var err error
			outs, err = d.ledger.ApplyShare(p, ops, next, past)
			if errors.As(err, &need) && attempt > 0 {
				if err := s.remeasure(ctx, ops, need.Ops); err != nil {
					return err
				}
				outs, err = d.ledger.ApplyShare(p, ops, next, past)
			}
			return err
		})
		if !errors.As(err, &need) || attempt > 0 {
			return outs, err
		}
		// The past posteriors are found without d.mu: finding one may mean playing the log.
		cur := d.current().Version
		var versions []uint64
		for _, v := range need.Versions {
			if _, ok := past[v]; !ok && v < cur {
				versions = append(versions, v)
			}
		}
		more, err := d.rep.Past(ctx, versions)
		if err != nil {
			return nil, err
		}
		if past == nil {
			past = map[uint64]*bnn.Model{}
		}
		maps.Copy(past, more)
	}
}

// pastVersions are the posterior versions before cur that ops need, sorted, once each: those
// their restored verdicts were measured under (without its posterior, a verdict is measured
// again), and the anchors of their registrations and states that are not live anchors of this
// ledger (live), whose posteriors it keeps itself. Registrations of ids the ledger holds
// (stored) need none: they store nothing.
func pastVersions(ops []ledger.ShareOp, cur uint64, live map[uint64]bool, stored func(id string) bool) []uint64 {
	var vs []uint64
	add := func(v uint64) {
		if v < cur && !slices.Contains(vs, v) {
			vs = append(vs, v)
		}
	}
	anchor := func(v uint64) {
		if !live[v] {
			add(v)
		}
	}
	for _, op := range ops {
		if op.CE == nil || stored(op.ID) {
			continue
		}
		anchor(op.CE.AnchorVersion)
		if st := op.State; st != nil {
			anchor(st.AnchorVersion)
			if st.ConfirmedVersion != nil {
				add(*st.ConfirmedVersion)
			}
		}
	}
	slices.Sort(vs)
	return vs
}

// remeasure measures the CEs of ops[which] again under the current posterior (d.mu held): a
// registration whose anchor the posterior log here does not have (a log begun after it). A
// state the previous owner left is then not used: its anchor lies between its registration's
// and the current version (ledger's checkState), and the log holds every version from its
// genesis on, so a state whose anchor is missing belongs to a registration whose anchor is
// missing too, which, measured again, is newer than the state.
func (s *share) remeasure(ctx context.Context, ops []ledger.ShareOp, which []int) error {
	d := s.d
	m := d.current()
	pool, err := d.pools.get(m)
	if err != nil {
		return err
	}
	rows := make([][]float64, len(which))
	for k, i := range which {
		rows[k] = ops[i].CE.XCF
	}
	pr, err := predictSplit(ctx, pool, rows)
	if err != nil {
		return err
	}
	for k, i := range which {
		ce := ops[i].CE
		s.lg.Warn("CE measured again under the current posterior: the one it was measured under is not in the posterior log here",
			"id", ce.ID, "anchor_version", ce.AnchorVersion, "posterior_version", m.Version)
		ce.AnchorVersion, ce.P1, ce.Var1, ce.Samples = m.Version, pr.P(k, ce.Target), pr.V(k, ce.Target), d.cfg.Certify.Samples
	}
	return nil
}

// awaitVersion waits until this replica has applied posterior version v, at most awaitOwner.
func (s *share) awaitVersion(ctx context.Context, v uint64) {
	ctx, cancel := context.WithTimeout(ctx, awaitOwner)
	defer cancel()
	for s.d.current().Version < v {
		if s.d.rep.WaitChange(ctx) != nil {
			return
		}
	}
}

// measured is a registration as the replica that accepted it measured it: the CE of a register
// request on the CE topic. Its owner judges the rest (status, bounds).
type measured struct {
	X             []float64 `json:"x"`
	XCF           []float64 `json:"x_cf"`
	Target        int       `json:"target"`
	AnchorVersion uint64    `json:"anchor_version"`
	P1            float64   `json:"p1"`
	Var1          float64   `json:"var1"`
	Samples       int       `json:"samples"`
	Delta         float64   `json:"delta"`
	Epsilon       float64   `json:"epsilon"`
}

// send puts registrations on the CE topic, one request each, with the request id and
// fingerprint of reqs[i] (a random request id when it has none); errs[i] is ces[i]'s outcome,
// offsets[i] where its request landed in its partition.
func (s *share) send(ctx context.Context, ces []*ledger.CE, reqs []ledger.RequestRef) (errs []error, offsets []int64) {
	errs, offsets = make([]error, len(ces)), make([]int64, len(ces))
	var failed error // a request that could not be sent within sendTimeout: the rest of the batch is not tried
	for i, ce := range ces {
		if ce.ID == "" {
			ce.ID = ledger.NewID()
		}
		if reqs[i].RID == "" {
			reqs[i].RID = newRID()
		}
		raw, err := json.Marshal(measured{X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: ce.AnchorVersion, P1: ce.P1,
			Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon})
		if err != nil {
			errs[i] = err
			continue
		}
		// A CE sent again (Reset) keeps its creation time: its next owner stores it with it, and
		// uses its state only with it (ledger.SameCE).
		at := ce.CreatedAt
		if at.IsZero() {
			at = time.Now().UTC()
		}
		req := ceshare.Request{Kind: ceshare.KindRegister, ID: ce.ID, CE: raw, Replica: s.id, At: at,
			RID: reqs[i].RID, Fingerprint: reqs[i].Fingerprint}
		if failed != nil {
			errs[i] = fmt.Errorf("%w: the registration was not sent: the CE topic did not take another request of its batch within %s (%v)",
				ledger.ErrWrite, sendTimeout, failed)
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, sendTimeout)
		_, offsets[i], err = s.prod.Send(sctx, req)
		cancel()
		if err != nil {
			errs[i] = fmt.Errorf("%w: the registration could not be sent to the CE topic within %s, and may or may not be applied "+
				"(a retry with an Idempotency-Key is the same request): %v", ledger.ErrWrite, sendTimeout, err)
			failed = err
		}
	}
	return errs, offsets
}

// newRID is a random request id.
func newRID() string { return rand.Text() }

// errPending: a registration or deletion was sent, and its owner has not applied it yet.
var errPending = errors.New("accepted; its owner has not applied it yet")

// unaskedError is errPending when no question to the owner was answered within the wait: the
// owner unreachable, refusing this replica's TLS handshake, or too slow. err is the last
// question's failure, or the wait's end when no question failed before it.
type unaskedError struct{ err error }

func (e *unaskedError) Error() string {
	return "accepted; whether its owner applied it is not known: no answer from it within replication.register_wait: " + e.err.Error()
}
func (e *unaskedError) Is(target error) bool { return target == errPending }
func (e *unaskedError) Unwrap() error        { return e.err }

// await waits until the owner of want's partition has applied the partition past offset, where
// the registration sent as ref landed, and answers the outcome of ref's request
// (answerOutcome): what the owner decided when it applied the request, in the partition's
// order, whatever it held when the registration was accepted. A request applied before (a
// retry with its Idempotency-Key) is answered once the owner has read the retry too, so that a
// deletion between the two is seen.
func (s *share) await(ctx context.Context, want *ledger.CE, ref ledger.RequestRef, offset int64) (*ledger.CE, error) {
	ro, err := s.awaitOutcome(ctx, want.ID, ref.RID, offset)
	if err != nil {
		return want, err
	}
	return answerOutcome(ro.Outcome, ro.Counterfactual, want.X, want.XCF, ref.Fingerprint)
}

// awaitOutcome waits, at most s.wait, until the owner of id's partition has applied the
// partition past offset, where request rid landed, and returns the request's outcome; errPending
// when the owner has not applied it in time (an *unaskedError when no question to it was
// answered). An outcome recorded at another offset is that of an
// earlier attempt of the request (a retry, not applied again): the answer replays it. When this
// replica owns the partition its own Apply wakes it at once; another owner holds each question
// until it applied past offset (outcomeHold at most), so a request costs one question or a few,
// not one per poll; two questions are at least outcomeGap apart.
func (s *share) awaitOutcome(ctx context.Context, id, rid string, offset int64) (requestOutcome, error) {
	if s.wait <= 0 {
		return requestOutcome{}, errPending // replication.register_wait 0: answered at once, nobody asked
	}
	ctx, cancel := context.WithTimeout(ctx, s.wait)
	defer cancel()
	answered := false // a question got the owner's answer (applied or not yet)
	var failed error  // the last question that failed before the wait ended
	for {
		// Taken before asking: this replica's Apply after the answer wakes the wait below, when
		// it owns the partition (another owner's apply ends its own hold of the question).
		var applied <-chan struct{}
		if slices.Contains(s.member.Owned(), ceshare.Partition(id, s.partitions)) {
			applied = s.applied.wait()
		}
		asked := time.Now()
		ro, ok, err := s.outcome(ctx, id, rid, offset)
		if err == nil && ok && ro.Applied > offset {
			if ro.Outcome.Offset != offset {
				s.d.requests.Replayed(ro.Outcome.Result)
			}
			return ro, nil
		}
		switch {
		case err == nil:
			answered = true
		case ctx.Err() == nil:
			failed = err
		}
		select {
		case <-ctx.Done():
			switch {
			case answered:
				return ro, errPending
			case failed != nil:
				return ro, &unaskedError{failed}
			}
			return ro, &unaskedError{fmt.Errorf("none within %v", s.wait)}
		case <-applied:
		case <-time.After(outcomeGap - time.Since(asked)):
		}
	}
}

// outcome returns the outcome of request rid, for CE id, from the owner of id's partition; ok
// is false while the owner has not applied the request. Another owner is asked to hold its
// answer until it applied the partition past after (headerAppliedAfter).
func (s *share) outcome(ctx context.Context, id, rid string, after int64) (ro requestOutcome, ok bool, err error) {
	p := ceshare.Partition(id, s.partitions)
	owner := ceshare.Owner{Replica: s.id}
	if !slices.Contains(s.member.Owned(), p) {
		if owner, err = s.dir.Owner(ctx, id); err != nil {
			return ro, false, err
		}
	}
	if owner.Replica == s.id {
		return s.d.localOutcome(id, rid)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, owner.URL+"/v1/counterfactuals/"+url.PathEscape(id), nil)
	if err != nil {
		return ro, false, err
	}
	if s.d.cfg.HTTP.Token != "" {
		req.Header.Set("Authorization", "Bearer "+s.d.cfg.HTTP.Token)
	}
	req.Header.Set(headerForwarded, s.id)
	req.Header.Set(headerRequestID, rid)
	req.Header.Set(headerAppliedAfter, strconv.FormatInt(after, 10))
	resp, err := s.client.Do(req)
	if err != nil {
		return ro, false, fmt.Errorf("asking %s (%s), the owner of partition %d: %w", owner.Replica, owner.URL, p, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return ro, false, err
	}
	switch resp.StatusCode {
	case http.StatusOK:
		if err := json.NewDecoder(bytes.NewReader(body)).Decode(&ro); err != nil {
			return ro, false, fmt.Errorf("%s's answer: %w", owner.Replica, err)
		}
		return ro, true, nil
	case http.StatusNotFound:
		return ro, false, nil
	}
	return ro, false, fmt.Errorf("%s, the owner of partition %d, answered %d: %s", owner.Replica, p, resp.StatusCode, bytes.TrimSpace(body))
}

// headerRequestID, on a request one replica forwards to another (headerForwarded), asks GET
// /v1/counterfactuals/{id} for the outcome of the request with this id instead of the CE: the
// owner answers a requestOutcome, or 404 while it has not applied the request. With
// headerAppliedAfter (an offset of the id's partition), the owner holds its answer until it
// applied the partition past that offset, outcomeHold at most (Daemon.holdOutcome).
const (
	headerRequestID    = "Cfguard-Request-Id"
	headerAppliedAfter = "Cfguard-Applied-After"
)

// requestOutcome is the owner's answer to a GET with headerRequestID: the request's outcome,
// the CE stored under its id now (null when none), and the offset of the partition the owner
// had applied up to before it read them (on a single daemon, 0).
type requestOutcome struct {
	Outcome        ledger.Outcome `json:"outcome"`
	Counterfactual *ledger.CE     `json:"counterfactual"`
	Applied        int64          `json:"applied"`
}

// find returns the CE id from its owner: this ledger when it owns id's partition, else the
// owner's API (forwarding the request's Authorization). replica names who answered.
func (s *share) find(ctx context.Context, id, authorization string) (ce *ledger.CE, replica string, err error) {
	p := ceshare.Partition(id, s.partitions)
	if slices.Contains(s.member.Owned(), p) {
		ce, err := s.local(id)
		return ce, s.id, err
	}
	owner, err := s.dir.Owner(ctx, id)
	if err != nil {
		return nil, "", err
	}
	if owner.Replica == s.id {
		ce, err := s.local(id)
		return ce, s.id, err
	}
	a, err := s.ask(ctx, owner, http.MethodGet, "/v1/counterfactuals/"+url.PathEscape(id), nil, authorization)
	if err != nil {
		return nil, "", err
	}
	if a.code == http.StatusNotFound {
		return nil, owner.Replica, fmt.Errorf("%w: %q", ledger.ErrNotFound, id)
	}
	var got ledger.CE
	if err := decodePeer(owner, a, &got); err != nil {
		return nil, owner.Replica, fmt.Errorf("the owner of partition %d: %w", p, err)
	}
	return &got, owner.Replica, nil
}

// errRebuilding is the error of a read of an id this replica's ledger does not hold in a
// partition it is still rebuilding from the CE topic (acquired, not caught up): the CE may be
// among the registrations still to replay, so the answer is not known yet (503, not 404).
var errRebuilding = errors.New("CE partition being rebuilt by its owner")

// local reads CE id from this replica's ledger, as the owner of its partition: errRebuilding
// when the id is not stored and the partition is not caught up here (being rebuilt, or not
// acquired yet: the group, which the directory described, gave it to this replica and the
// member has not taken it; or a forwarding replica read the group before a rebalance).
func (s *share) local(id string) (*ledger.CE, error) {
	ce, err := s.d.ledger.Get(id)
	if p := ceshare.Partition(id, s.partitions); errors.Is(err, ledger.ErrNotFound) && !s.member.Ready(p) {
		return nil, s.rebuildingErr(p)
	}
	return ce, err
}

// rebuilding is errRebuilding for the first partition this replica holds or was assigned that
// it has not caught up with, nil when there is none: a list of this ledger's CEs misses some.
func (s *share) rebuilding() error {
	if ps := s.notCaughtUp(); len(ps) > 0 {
		return s.rebuildingErr(ps[0])
	}
	return nil
}

// holdsWhole says why this replica's ledger may not hold every CE of the partitions expect (the
// ones the CE group gives it, as a listing replica read them from the group) and of those it
// holds or was assigned: one it has not caught up with, or does not hold yet (its member has
// not taken up the group's latest assignment), or a member between two generations, which does
// not know its partitions; nil when there is none. The directory a listing replica reads the
// assignment from sees a new generation as soon as the group does, before each member takes it
// up.
func (s *share) holdsWhole(expect []int) error {
	if s.member.Generation() == 0 {
		return fmt.Errorf("%w: this replica is between two generations of the CE group of %s; retry", errRebuilding, s.d.cfg.Replication.CETopic)
	}
	for _, p := range expect {
		if !s.member.Ready(p) {
			return s.rebuildingErr(p)
		}
	}
	return s.rebuilding()
}

// notCaughtUp are the partitions this replica holds or was assigned and has not caught up with
// since it acquired them, sorted (cfguard_counterfactuals_partitions_rebuilding counts them).
func (s *share) notCaughtUp() []int {
	ps := []int{}
	for _, p := range slices.Concat(s.member.Owned(), s.member.Assigned()) {
		if !s.member.Ready(p) && !slices.Contains(ps, p) {
			ps = append(ps, p)
		}
	}
	slices.Sort(ps)
	return ps
}

// caughtUp waits until this replica holds every CE of its partitions (holdsWhole), at most
// wait; after that, or when ctx ends, it returns holdsWhole's error.
func (s *share) caughtUp(ctx context.Context, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		applied := s.applied.wait()
		err := s.holdsWhole(nil)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-applied: // a partition catches up after an Apply, once the member saw its end
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (s *share) rebuildingErr(p int) error {
	next, _ := s.member.Next(p)
	return fmt.Errorf("%w: partition %d of %s, its requests replayed up to offset %d; retry", errRebuilding, p, s.d.cfg.Replication.CETopic, next)
}

// headerForwarded marks a request one replica forwards to another, naming the sender; the
// owner answers from its ledger and never forwards it again.
const headerForwarded = "Cfguard-Forwarded-By"

// paramPartitions names, on a list request one replica forwards to another, the partitions the
// CE group gives the owner as the sender read them (share.listAt).
const paramPartitions = "partitions"

// forget sends a deletion of id as the request ref (a random request id when it has none) to
// the CE topic and answers the outcome its owner recorded for it once the owner has applied the
// partition past it (answerDeletion): nil when it deleted a CE, ledger.ErrNotFound when nothing
// was stored under id at the request's offset; errPending when the owner has not applied it
// within replication.register_wait. A keyed retry is sent again and skipped by the owner, which answers the
// first attempt's outcome, so it deletes nothing registered since.
func (s *share) forget(ctx context.Context, id string, ref ledger.RequestRef) error {
	if ref.RID == "" {
		ref.RID = newRID()
	}
	sctx, cancel := context.WithTimeout(ctx, sendTimeout)
	_, offset, err := s.prod.Send(sctx, ceshare.Request{Kind: ceshare.KindDelete, ID: id, Replica: s.id, At: time.Now().UTC(),
		RID: ref.RID, Fingerprint: ref.Fingerprint})
	cancel()
	if err != nil {
		return fmt.Errorf("%w: the deletion could not be sent to the CE topic within %s, and may or may not be applied (a retry with an "+
			"Idempotency-Key is the same request): %v", ledger.ErrWrite, sendTimeout, err)
	}
	ro, err := s.awaitOutcome(ctx, id, ref.RID, offset)
	if err != nil {
		return fmt.Errorf("%w (the deletion is on the CE topic; GET the counterfactual later)", err)
	}
	return answerDeletion(ro.Outcome, ref.Fingerprint)
}
