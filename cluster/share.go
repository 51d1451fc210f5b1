package cluster

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
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/replica"
	"github.com/cfguard/cfguard/stream"
)

// Host is what a Share needs of the daemon it runs in.
type Host interface {
	// Current is the posterior the replica serves.
	Current() *bnn.Model
	// Durably runs fn, a write to the ledger, until it does not fail with ledger.ErrWrite (the
	// daemon's degraded mode) or ctx ends.
	Durably(ctx context.Context, fn func() error) error
	// Exclusive runs fn with no posterior committed while it runs: the ledger's judgement of a
	// batch of requests and its write see one current posterior.
	Exclusive(fn func() error) error
	// Predict measures rows under m (the version's shared Monte-Carlo draws).
	Predict(ctx context.Context, m *bnn.Model, rows [][]float64) (*bnn.Predictive, error)
	// Applied is called after each batch of requests the ledger applied: CEs to judge.
	Applied()
}

// Config is what NewShare needs.
type Config struct {
	Replication config.Replication
	Group       string // the CE group: <kafka.group_id>.ce
	Token       string // http.token, sent to peers when a request carries no Authorization
	Samples     int    // certify.samples, of a CE measured again
	// AdvertiseURL is where the other replicas reach this one's API (see AdvertiseURL).
	AdvertiseURL string
	Conn         stream.ConnConfig
	Ledger       *ledger.Ledger
	Replica      *replica.Replica
	States       *States
	Requests     *alerts.RequestMetrics
	Host         Host
	Logger       *slog.Logger
	// OnGeneration is ceshare.MemberConfig.OnGeneration (tests).
	OnGeneration func(ctx context.Context, generation int32, assigned []int)
	// BeforeAwait, when set, is called when a batch of requests waits for the posterior version
	// it needs, before it waits (tests).
	BeforeAwait func(version uint64)
}

// Share is a replica's part in the CEs (package ceshare, docs/DESIGN.md): registrations and
// deletions accepted by any replica are requests on the CE topic, keyed by CE id; the replica
// that the CE group gives a partition keeps that partition's CEs in its ledger, re-certifies
// them at every entry of the posterior log, confirms, renews and audits them, and publishes
// their status changes. Reads of a CE another replica owns are forwarded to it.
type Share struct {
	id             string // replication.replica_id (or the host name)
	partitions     int
	topic          string // replication.ce_topic
	group          string
	sessionTimeout time.Duration
	token          string
	samples        int
	ledger         *ledger.Ledger
	rep            *replica.Replica
	metrics        *alerts.ReplicaMetrics
	requests       *alerts.RequestMetrics
	host           Host
	beforeAwait    func(version uint64)
	prod           *ceshare.Producer
	member         *ceshare.Member
	dir            *ceshare.Directory
	client         *http.Client  // questions to peers: reads, lists, outcomes (PeerTimeout)
	wait           time.Duration // how long a request waits for its owner's outcome: replication.register_wait
	// auditClient forwards POST /v1/audit, which takes as long as the peer's share needs
	// (minutes at 10^6 CEs): bounded by the caller's context only.
	auditClient *http.Client
	lg          *slog.Logger
	applied     broadcast // signalled after each Apply: outcomes waited for may be stored
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

// AwaitOwner bounds how long an owner's batch of requests waits for a posterior version it has
// not applied yet (awaitVersion). How long a request waits for its owner before it is answered
// 202 is replication.register_wait (Share.wait).
const AwaitOwner = 10 * time.Second

// PeerTimeout bounds a question to another replica (a read, a page, an outcome, an audit's
// status), from the request to the end of its answer.
const PeerTimeout = 10 * time.Second

// AuditRebuildWait bounds how long an audit waits for this replica's partitions to be rebuilt
// before it measures them (a rebuild of 10^6 CEs took 50 s: BENCHMARKS.md, Replicas).
const AuditRebuildWait = 2 * time.Minute

// OutcomeHold bounds how long an owner holds another replica's question for a request's
// outcome (Share.outcome) before it answers what it has; OutcomeGap is the least time between
// two questions of one waiting request.
const (
	OutcomeHold = 2 * time.Second
	OutcomeGap  = 20 * time.Millisecond
)

// SendTimeout bounds how long one registration or deletion request is retried against the CE
// topic (a partition electing a leader answers within it); a batch whose request times out
// sends none of its later requests. Past it the request is
// answered 503 with Retry-After: the topic is gone or unreachable, and a client waiting for ever
// would not know.
const SendTimeout = 10 * time.Second

// AdvertiseURL is replication.advertise_url (configured), or the API's bound address when
// http.listen names a host, or <host name>:<port> when it listens on every interface; the
// scheme is https when the API serves TLS (http.web_config_file), else http.
func AdvertiseURL(configured string, bound net.Addr, tls bool) (string, error) {
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

// NewShare joins the CE topic: a producer for requests, a member of the CE group (run by Run)
// and a directory of owners.
func NewShare(ctx context.Context, c Config) (*Share, error) {
	rc := c.Replication
	tr, err := replica.PeerTransport(rc)
	if err != nil {
		return nil, err
	}
	s := &Share{id: c.Replica.ID(), partitions: rc.CEPartitions, topic: rc.CETopic, group: c.Group, sessionTimeout: rc.SessionTimeout,
		token: c.Token, samples: c.Samples, ledger: c.Ledger, rep: c.Replica, metrics: c.Replica.Metrics(), requests: c.Requests,
		host: c.Host, beforeAwait: c.BeforeAwait, client: &http.Client{Timeout: PeerTimeout, Transport: tr}, wait: rc.RegisterWait,
		auditClient: &http.Client{Transport: tr}, lg: c.Logger.With("component", "ceshare")}
	held, err := c.Ledger.ShareOffsets()
	if err != nil {
		return nil, err
	}
	m := s.metrics
	if s.member, err = ceshare.NewMember(ctx, ceshare.MemberConfig{Conn: c.Conn, Topic: rc.CETopic, Group: c.Group, Partitions: rc.CEPartitions,
		StateTopic: ceshare.StateTopic(rc.CETopic), ReplicaID: s.id, AdvertiseURL: c.AdvertiseURL, Held: slices.Sorted(maps.Keys(held)),
		SessionTimeout: rc.SessionTimeout, HeartbeatInterval: rc.HeartbeatInterval, Keys: c.Replica.Keys(),
		OnUnauthenticated: func(topic string, _ int, _ int64) { m.Unauthenticated.WithLabelValues(topic).Inc() },
		OnMalformedState:  func(int, int64) { m.CEStates.WithLabelValues(alerts.StateInvalid).Inc() },
		OnFencedState:     func(int, int64) { m.CEStates.WithLabelValues(alerts.StateFenced).Inc() },
		OnGeneration:      c.OnGeneration}, s, s.lg); err != nil {
		return nil, err
	}
	c.States.member.Store(s.member)
	m.SetRebuilding(func() int { return len(s.NotCaughtUp()) })
	if s.prod, err = ceshare.NewProducer(ctx, c.Conn, rc.CETopic, c.Replica.Keys(), s.lg); err != nil {
		return nil, err
	}
	if s.dir, err = ceshare.NewDirectory(ctx, c.Conn, c.Group, rc.CETopic, rc.CEPartitions, c.Replica.Keys(), s.lg); err != nil {
		s.prod.Close()
		return nil, err
	}
	s.lg.Info("sharing the CEs", "topic", rc.CETopic, "partitions", rc.CEPartitions, "group", c.Group, "advertise_url", c.AdvertiseURL)
	return s, nil
}

// ID is this replica's id (replication.replica_id, or the host name).
func (s *Share) ID() string { return s.id }

// Partitions is replication.ce_partitions.
func (s *Share) Partitions() int { return s.partitions }

// Member is this replica's member of the CE group.
func (s *Share) Member() *ceshare.Member { return s.member }

// Close closes the producer and the directory.
func (s *Share) Close() error { return errors.Join(s.prod.Close(), s.dir.Close()) }

// Health is the share's part of /readyz: not before the CE group gave this replica its share
// (a replica restarted after a crash owns nothing until the group's session of its previous run
// expires), nor while a partition it owns is being restored. A nil Share (not joined yet) is healthy.
func (s *Share) Health() error {
	if s == nil {
		return nil
	}
	if s.member.Stats().Generations == 0 {
		return fmt.Errorf("joining the CE group of %s", s.topic)
	}
	// Assigned too: a partition of a new generation is assigned before it is acquired.
	return s.rebuilding()
}

// Run is the member of the CE group until ctx ends, once no other member carries this
// replica's id (uniqueID).
func (s *Share) Run(ctx context.Context) error {
	if err := s.uniqueID(ctx, 2*s.sessionTimeout+5*time.Second); err != nil {
		return err
	}
	return s.member.Run(ctx)
}

// uniqueID waits until no member of the CE group carries this replica's id, and fails when one
// still does after wait: two replicas with one replication.replica_id would each take the
// other's partitions for their own and answer 404 for CEs the other stores. A previous process
// of this replica that did not leave the group (killed) is gone once its session expires, within
// replication.session_timeout; a replica configured with the same id stays.
func (s *Share) uniqueID(ctx context.Context, wait time.Duration) error {
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
				"still there after %s: give each replica its own replication.replica_id", s.id, s.group, twin.MemberID,
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
func (s *Share) Acquire(ctx context.Context, p int) (int64, error) {
	off, ok, err := s.ledger.ShareOffset(p)
	if err != nil {
		return 0, err
	}
	s.metrics.CEPartitions.Set(float64(len(s.member.Owned())))
	s.lg.Info("CE partition acquired", "partition", p, "from", off, "held_before", ok)
	return off, nil
}

// Release is ceshare.Hooks: partition p's CEs leave this ledger (their new owner rebuilds them
// from the CE topic). A release cut short leaves p's offset at 0 (ledger.ReleaseShare), and a
// restart that is not given p back releases it again (MemberConfig.Held).
func (s *Share) Release(ctx context.Context, p int) error {
	n, err := s.ledger.ReleaseShare(ctx, p, func(id string) bool { return ceshare.Partition(id, s.partitions) == p })
	if err != nil {
		return err
	}
	s.metrics.CEPartitions.Set(float64(len(s.member.Owned())))
	s.lg.Info("CE partition released", "partition", p, "counterfactuals", n)
	return nil
}

// Lost is ceshare.Hooks: the requests of partition p from `from` to `to` were deleted from the
// CE topic before this replica read them. The ledger moves p's offset past them and counts them
// (cfguard_records_lost_total for the CE topic, CfguardRecordsLost) in one transaction; the CEs
// they registered are not in this share (but for those restored from their states before the
// gap: ceshare.Request.Restored), and those they deleted stay. A ledger that cannot be
// written is retried as every share write is (durably).
func (s *Share) Lost(ctx context.Context, p int, from, to int64) error {
	return s.host.Durably(ctx, func() error { return s.ledger.SkipShare(p, from, to) })
}

// Reset is ceshare.Hooks: partition p of the CE topic ends at end, before what this ledger read
// (the topic was deleted and created again), so the requests that registered p's CEs are gone.
// The partition's offset goes back to 0 first (a crash after it leaves the CEs in this ledger
// and no request of the new log skipped), then every CE of p this ledger holds is sent again
// as a registration with its anchor and certificate: reading p from 0, this replica applies them
// as already stored, and a later owner of p stores them from the topic.
// cfguard_counterfactuals_repaired_total counts them; one that cannot be sent stays in this
// ledger only (an ERROR line says how many).
func (s *Share) Reset(ctx context.Context, p int, end int64) error {
	if err := s.host.Durably(ctx, func() error { _, err := s.ledger.ApplyShare(p, nil, 0, nil); return err }); err != nil {
		return err
	}
	var ces []*ledger.CE
	for after := ""; ; {
		page, err := s.ledger.List(0, 1000, after)
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
		errs, _ := s.Send(ctx, batch, make([]ledger.RequestRef, len(batch)))
		for _, err := range errs {
			if err != nil {
				failed++
			} else {
				sent++
			}
		}
	}
	s.metrics.CERepaired.Add(float64(sent))
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
// is what the replica that accepted it answers (AwaitOutcome). A registration rebuilt from a CE
// state at a gap of deleted requests (ceshare.Request.Restored) is stored from its state
// (restoredOp), with no outcome, and p's offset stays at next.
//
// Each registration is anchored to the posterior it was measured under: the current one, a
// live anchor, or a past version taken from the posterior log (replica.Replica.Past). A CE measured
// under a version this replica has not applied yet waits for it (at most AwaitOwner), and so does
// the state its previous owner left of it (up to its verdict's and history's versions, which
// checkState wants applied; a replica that joined while its follower still plays the log gets
// there within the wait): a CE whose version it still lacks then is measured again under the
// current posterior, as a registration here would be, and a state past it is not used.
func (s *Share) Apply(ctx context.Context, p int, reqs []ceshare.Request, next int64) error {
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
		var ce Measured
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
	if s.beforeAwait != nil {
		s.beforeAwait(newest)
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
	s.metrics.CEApplied.Add(float64(applied))
	s.host.Applied()
	s.applied.signal()
	return nil
}

// noteOutcome counts and logs what became of request r of partition p (o): a duplicate, a
// refusal, a state used or not.
func (s *Share) noteOutcome(p int, r ceshare.Request, o ledger.Outcome) {
	if o.Duplicate {
		s.requests.Skipped(r.Kind, 1)
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
		s.metrics.CEStates.WithLabelValues(alerts.StateRestored).Inc()
	case o.State != "" && r.Restored:
		s.metrics.CEStates.WithLabelValues(alerts.StateNotUsed).Inc()
		s.lg.Warn("CE restored without its state's renewals, verdict and history", "partition", p, "id", o.ID, "why", o.State)
	case o.State != "":
		s.metrics.CEStates.WithLabelValues(alerts.StateNotUsed).Inc()
		s.lg.Warn("CE stored from its registration", "partition", p, "id", o.ID, "why", o.State)
	}
}

// applyOps is ledger.ApplyShare under Host.Exclusive (no posterior is committed between the ledger's
// judgement and its write), with the past posteriors its registrations need: first with those
// the batch names (pastVersions), then with any others the ledger still asks for that the
// posterior log has, then with the registrations still lacking theirs measured again under the
// current posterior.
func (s *Share) applyOps(ctx context.Context, p int, ops []ledger.ShareOp, next int64) ([]ledger.Outcome, error) {
	var outs []ledger.Outcome
	anchors, err := s.ledger.Anchors()
	if err != nil {
		return nil, err
	}
	live := map[uint64]bool{}
	for _, a := range anchors {
		live[a.Version] = true
	}
	stored := func(id string) bool { // a request replayed after a restart, applied before
		_, err := s.ledger.Get(id)
		return !errors.Is(err, ledger.ErrNotFound)
	}
	// Asked for at once, so that one play of the log finds them all (replica.Replica.Past).
	past, err := s.rep.Past(ctx, pastVersions(ops, s.host.Current().Version, live, stored))
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		s.lg.Warn("past posteriors not found in the posterior log: restored verdicts are measured again", "partition", p, "err", err)
		past = nil
	}
	for attempt := 0; ; attempt++ {
		var need *ledger.AnchorsNeededError
		err := s.host.Durably(ctx, func() error {
			return s.host.Exclusive(func() error {
				var err error
				outs, err = s.ledger.ApplyShare(p, ops, next, past)
				if errors.As(err, &need) && attempt > 0 {
					if err := s.remeasure(ctx, ops, need.Ops); err != nil {
						return err
					}
					outs, err = s.ledger.ApplyShare(p, ops, next, past)
				}
				return err
			})
		})
		if !errors.As(err, &need) || attempt > 0 {
			return outs, err
		}
		// The past posteriors are found outside Exclusive: finding one may mean playing the log.
		cur := s.host.Current().Version
		var versions []uint64
		for _, v := range need.Versions {
			if _, ok := past[v]; !ok && v < cur {
				versions = append(versions, v)
			}
		}
		more, err := s.rep.Past(ctx, versions)
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

// remeasure measures the CEs of ops[which] again under the current posterior (in Exclusive): a
// registration whose anchor the posterior log here does not have (a log begun after it). A
// state the previous owner left is then not used: its anchor lies between its registration's
// and the current version (ledger's checkState), and the log holds every version from its
// genesis on, so a state whose anchor is missing belongs to a registration whose anchor is
// missing too, which, measured again, is newer than the state.
func (s *Share) remeasure(ctx context.Context, ops []ledger.ShareOp, which []int) error {
	m := s.host.Current()
	rows := make([][]float64, len(which))
	for k, i := range which {
		rows[k] = ops[i].CE.XCF
	}
	pr, err := s.host.Predict(ctx, m, rows)
	if err != nil {
		return err
	}
	for k, i := range which {
		ce := ops[i].CE
		s.lg.Warn("CE measured again under the current posterior: the one it was measured under is not in the posterior log here",
			"id", ce.ID, "anchor_version", ce.AnchorVersion, "posterior_version", m.Version)
		ce.AnchorVersion, ce.P1, ce.Var1, ce.Samples = m.Version, pr.P(k, ce.Target), pr.V(k, ce.Target), s.samples
	}
	return nil
}

// awaitVersion waits until this replica has applied posterior version v, at most AwaitOwner.
func (s *Share) awaitVersion(ctx context.Context, v uint64) {
	ctx, cancel := context.WithTimeout(ctx, AwaitOwner)
	defer cancel()
	for s.host.Current().Version < v {
		if s.rep.WaitChange(ctx) != nil {
			return
		}
	}
}

// Measured is a registration as the replica that accepted it measured it: the CE of a register
// request on the CE topic. Its owner judges the rest (status, bounds).
type Measured struct {
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

// Send puts registrations on the CE topic, one request each, with the request id and
// fingerprint of reqs[i] (a random request id when it has none); errs[i] is ces[i]'s outcome,
// offsets[i] where its request landed in its partition.
func (s *Share) Send(ctx context.Context, ces []*ledger.CE, reqs []ledger.RequestRef) (errs []error, offsets []int64) {
	errs, offsets = make([]error, len(ces)), make([]int64, len(ces))
	var failed error // a request that could not be sent within SendTimeout: the rest of the batch is not tried
	for i, ce := range ces {
		if ce.ID == "" {
			ce.ID = ledger.NewID()
		}
		if reqs[i].RID == "" {
			reqs[i].RID = newRID()
		}
		raw, err := json.Marshal(Measured{X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: ce.AnchorVersion, P1: ce.P1,
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
				ledger.ErrWrite, SendTimeout, failed)
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, SendTimeout)
		_, offsets[i], err = s.prod.Send(sctx, req)
		cancel()
		if err != nil {
			errs[i] = fmt.Errorf("%w: the registration could not be sent to the CE topic within %s, and may or may not be applied "+
				"(a retry with an Idempotency-Key is the same request): %v", ledger.ErrWrite, SendTimeout, err)
			failed = err
		}
	}
	return errs, offsets
}

// newRID is a random request id.
func newRID() string { return rand.Text() }

// ErrPending: a registration or deletion was sent, and its owner has not applied it yet.
var ErrPending = errors.New("accepted; its owner has not applied it yet")

// unaskedError is ErrPending when no question to the owner was answered within the wait: the
// owner unreachable, refusing this replica's TLS handshake, or too slow. err is the last
// question's failure, or the wait's end when no question failed before it.
type unaskedError struct{ err error }

func (e *unaskedError) Error() string {
	return "accepted; whether its owner applied it is not known: no answer from it within replication.register_wait: " + e.err.Error()
}
func (e *unaskedError) Is(target error) bool { return target == ErrPending }
func (e *unaskedError) Unwrap() error        { return e.err }

// AwaitOutcome waits, at most replication.register_wait, until the owner of id's partition has
// applied the partition past offset, where request rid landed (Send), and returns the request's
// outcome: what the owner decided when it applied the request, in the partition's order,
// whatever it held when the request was accepted. A request applied before (a retry with its
// Idempotency-Key) is answered once the owner has read the retry too, so that a deletion between
// the two is seen. ErrPending
// when the owner has not applied it in time (an *unaskedError when no question to it was
// answered). An outcome recorded at another offset is that of an
// earlier attempt of the request (a retry, not applied again): the answer replays it. When this
// replica owns the partition its own Apply wakes it at once; another owner holds each question
// until it applied past offset (OutcomeHold at most), so a request costs one question or a few,
// not one per poll; two questions are at least OutcomeGap apart.
func (s *Share) AwaitOutcome(ctx context.Context, id, rid string, offset int64) (RequestOutcome, error) {
	if s.wait <= 0 {
		return RequestOutcome{}, ErrPending // replication.register_wait 0: answered at once, nobody asked
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
				s.requests.Replayed(ro.Outcome.Result)
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
				return ro, ErrPending
			case failed != nil:
				return ro, &unaskedError{failed}
			}
			return ro, &unaskedError{fmt.Errorf("none within %v", s.wait)}
		case <-applied:
		case <-time.After(OutcomeGap - time.Since(asked)):
		}
	}
}

// outcome returns the outcome of request rid, for CE id, from the owner of id's partition; ok
// is false while the owner has not applied the request. Another owner is asked to hold its
// answer until it applied the partition past after (HeaderAppliedAfter).
func (s *Share) outcome(ctx context.Context, id, rid string, after int64) (ro RequestOutcome, ok bool, err error) {
	p := ceshare.Partition(id, s.partitions)
	owner := ceshare.Owner{Replica: s.id}
	if !slices.Contains(s.member.Owned(), p) {
		if owner, err = s.dir.Owner(ctx, id); err != nil {
			return ro, false, err
		}
	}
	if owner.Replica == s.id {
		return s.LocalOutcome(id, rid)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, owner.URL+"/v1/counterfactuals/"+url.PathEscape(id), nil)
	if err != nil {
		return ro, false, err
	}
	if s.token != "" {
		req.Header.Set("Authorization", "Bearer "+s.token)
	}
	req.Header.Set(HeaderForwarded, s.id)
	req.Header.Set(HeaderRequestID, rid)
	req.Header.Set(HeaderAppliedAfter, strconv.FormatInt(after, 10))
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

// Outcome is the outcome of request rid in l, with the CE stored under id now; ok is false
// when l has not applied the request. Applied is 0: see Share.LocalOutcome.
func Outcome(l *ledger.Ledger, id, rid string) (ro RequestOutcome, ok bool, err error) {
	o, ok, err := l.Outcome(rid)
	if err != nil || !ok {
		return ro, false, err
	}
	ro.Outcome = o
	ce, err := l.Get(id)
	switch {
	case errors.Is(err, ledger.ErrNotFound):
	case err != nil:
		return ro, false, err
	default:
		ro.Counterfactual = ce
	}
	return ro, true, nil
}

// LocalOutcome is Outcome in this replica's ledger, with the offset of id's partition applied
// before they were read.
func (s *Share) LocalOutcome(id, rid string) (RequestOutcome, bool, error) {
	off, _, err := s.ledger.ShareOffset(ceshare.Partition(id, s.partitions))
	if err != nil {
		return RequestOutcome{}, false, err
	}
	ro, ok, err := Outcome(s.ledger, id, rid)
	ro.Applied = off
	return ro, ok, err
}

// HoldOutcome is LocalOutcome once this replica applied id's partition past offset after, or
// what it has after hold or when ctx ends: another replica waiting for the outcome
// (AwaitOutcome) asks once instead of polling. A negative after answers at once.
func (s *Share) HoldOutcome(ctx context.Context, id, rid string, after int64, hold time.Duration) (RequestOutcome, bool, error) {
	if after < 0 {
		return s.LocalOutcome(id, rid)
	}
	ctx, cancel := context.WithTimeout(ctx, hold)
	defer cancel()
	for {
		applied := s.applied.wait()
		ro, ok, err := s.LocalOutcome(id, rid)
		if err != nil || ok && ro.Applied > after {
			return ro, ok, err
		}
		select {
		case <-ctx.Done():
			return ro, ok, nil
		case <-applied:
		}
	}
}

// HeaderRequestID, on a request one replica forwards to another (HeaderForwarded), asks GET
// /v1/counterfactuals/{id} for the outcome of the request with this id instead of the CE: the
// owner answers a RequestOutcome, or 404 while it has not applied the request. With
// HeaderAppliedAfter (an offset of the id's partition), the owner holds its answer until it
// applied the partition past that offset, OutcomeHold at most (HoldOutcome).
const (
	HeaderRequestID    = "Cfguard-Request-Id"
	HeaderAppliedAfter = "Cfguard-Applied-After"
)

// RequestOutcome is the owner's answer to a GET with HeaderRequestID: the request's outcome,
// the CE stored under its id now (null when none), and the offset of the partition the owner
// had applied up to before it read them (on a single daemon, 0).
type RequestOutcome struct {
	Outcome        ledger.Outcome `json:"outcome"`
	Counterfactual *ledger.CE     `json:"counterfactual"`
	Applied        int64          `json:"applied"`
}

// Find returns the CE id from its owner: this ledger when it owns id's partition, else the
// owner's API (forwarding the request's Authorization). replica names who answered.
func (s *Share) Find(ctx context.Context, id, authorization string) (ce *ledger.CE, replica string, err error) {
	p := ceshare.Partition(id, s.partitions)
	if slices.Contains(s.member.Owned(), p) {
		ce, err := s.Local(id)
		return ce, s.id, err
	}
	owner, err := s.dir.Owner(ctx, id)
	if err != nil {
		return nil, "", err
	}
	if owner.Replica == s.id {
		ce, err := s.Local(id)
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

// ErrRebuilding is the error of a read of an id this replica's ledger does not hold in a
// partition it is still rebuilding from the CE topic (acquired, not caught up): the CE may be
// among the registrations still to replay, so the answer is not known yet (503, not 404).
var ErrRebuilding = errors.New("CE partition being rebuilt by its owner")

// Local reads CE id from this replica's ledger, as the owner of its partition: ErrRebuilding
// when the id is not stored and the partition is not caught up here (being rebuilt, or not
// acquired yet: the group, which the directory described, gave it to this replica and the
// member has not taken it; or a forwarding replica read the group before a rebalance).
func (s *Share) Local(id string) (*ledger.CE, error) {
	ce, err := s.ledger.Get(id)
	if p := ceshare.Partition(id, s.partitions); errors.Is(err, ledger.ErrNotFound) && !s.member.Ready(p) {
		return nil, s.rebuildingErr(p)
	}
	return ce, err
}

// rebuilding is ErrRebuilding for the first partition this replica holds or was assigned that
// it has not caught up with, nil when there is none: a list of this ledger's CEs misses some.
func (s *Share) rebuilding() error {
	if ps := s.NotCaughtUp(); len(ps) > 0 {
		return s.rebuildingErr(ps[0])
	}
	return nil
}

// HoldsWhole says why this replica's ledger may not hold every CE of the partitions expect (the
// ones the CE group gives it, as a listing replica read them from the group) and of those it
// holds or was assigned: one it has not caught up with, or does not hold yet (its member has
// not taken up the group's latest assignment), or a member between two generations, which does
// not know its partitions; nil when there is none. The directory a listing replica reads the
// assignment from sees a new generation as soon as the group does, before each member takes it
// up.
func (s *Share) HoldsWhole(expect []int) error {
	if s.member.Generation() == 0 {
		return fmt.Errorf("%w: this replica is between two generations of the CE group of %s; retry", ErrRebuilding, s.topic)
	}
	for _, p := range expect {
		if !s.member.Ready(p) {
			return s.rebuildingErr(p)
		}
	}
	return s.rebuilding()
}

// NotCaughtUp are the partitions this replica holds or was assigned and has not caught up with
// since it acquired them, sorted (cfguard_counterfactuals_partitions_rebuilding counts them).
func (s *Share) NotCaughtUp() []int {
	ps := []int{}
	for _, p := range slices.Concat(s.member.Owned(), s.member.Assigned()) {
		if !s.member.Ready(p) && !slices.Contains(ps, p) {
			ps = append(ps, p)
		}
	}
	slices.Sort(ps)
	return ps
}

// CaughtUp waits until this replica holds every CE of its partitions (HoldsWhole), at most
// wait; after that, or when ctx ends, it returns holdsWhole's error.
func (s *Share) CaughtUp(ctx context.Context, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		applied := s.applied.wait()
		err := s.HoldsWhole(nil)
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

func (s *Share) rebuildingErr(p int) error {
	next, _ := s.member.Next(p)
	return fmt.Errorf("%w: partition %d of %s, its requests replayed up to offset %d; retry", ErrRebuilding, p, s.topic, next)
}

// HeaderForwarded marks a request one replica forwards to another, naming the sender; the
// owner answers from its ledger and never forwards it again.
const HeaderForwarded = "Cfguard-Forwarded-By"

// ParamPartitions names, on a list request one replica forwards to another, the partitions the
// CE group gives the owner as the sender read them (Share.listAt).
const ParamPartitions = "partitions"

// Forget sends a deletion of id as the request ref (a random request id when it has none) to
// the CE topic and answers the outcome its owner recorded for it once the owner has applied the
// partition past it: OutcomeDeleted when it deleted a CE, OutcomeAbsent when nothing was stored
// under id at the request's offset; ErrPending when the owner has not applied it within
// replication.register_wait. A keyed retry is sent again and skipped by the owner, which answers
// the first attempt's outcome, so it deletes nothing registered since.
func (s *Share) Forget(ctx context.Context, id string, ref ledger.RequestRef) (RequestOutcome, error) {
	if ref.RID == "" {
		ref.RID = newRID()
	}
	sctx, cancel := context.WithTimeout(ctx, SendTimeout)
	_, offset, err := s.prod.Send(sctx, ceshare.Request{Kind: ceshare.KindDelete, ID: id, Replica: s.id, At: time.Now().UTC(),
		RID: ref.RID, Fingerprint: ref.Fingerprint})
	cancel()
	if err != nil {
		return RequestOutcome{}, fmt.Errorf("%w: the deletion could not be sent to the CE topic within %s, and may or may not be applied (a retry with an "+
			"Idempotency-Key is the same request): %v", ledger.ErrWrite, SendTimeout, err)
	}
	ro, err := s.AwaitOutcome(ctx, id, ref.RID, offset)
	if err != nil {
		return ro, fmt.Errorf("%w (the deletion is on the CE topic; GET the counterfactual later)", err)
	}
	return ro, nil
}
