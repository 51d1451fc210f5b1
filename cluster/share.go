package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
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
	// Applied is called after each batch of requests the ledger applied: CEs to judge, and
	// waiting the CEs stored with a previous owner's state that waits for a reissue
	// (ledger.CE.ReissuePendingSince), which the ledger holds as waiting from that batch on.
	Applied(waiting []ledger.PendingReissue)
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
	// Now is ceshare.MemberConfig.Now: the clock the member reads to find a pause of this
	// process (tests; nil: time.Now).
	Now func() time.Time
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

// AuditRebuildWait bounds how long an audit waits for this replica's partitions to be rebuilt,
// and its share to settle (CaughtUp), before it measures them (a rebuild of 10^6 CEs took 50 s:
// BENCHMARKS.md, Replicas).
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
	var skip []ceshare.Skip
	for _, q := range rc.SkipCERequests {
		skip = append(skip, ceshare.Skip{Partition: q.Partition, Offset: q.Offset, Through: q.Through, ID: q.ID})
	}
	if s.member, err = ceshare.NewMember(ctx, ceshare.MemberConfig{Conn: c.Conn, Topic: rc.CETopic, Group: c.Group, Partitions: rc.CEPartitions,
		StateTopic: ceshare.StateTopic(rc.CETopic), ReplicaID: s.id, AdvertiseURL: c.AdvertiseURL, Held: slices.Sorted(maps.Keys(held)),
		SessionTimeout: rc.SessionTimeout, HeartbeatInterval: rc.HeartbeatInterval, Keys: c.Replica.Keys(), Readable: readable, Skip: skip,
		OnUnauthenticated: func(topic string, _ int, _ int64) { m.Unauthenticated.WithLabelValues(topic).Inc() },
		OnSkip:            func(int, int64) { m.CESkipped.Inc() },
		OnMalformedState:  func(int, int64) { m.CEStates.WithLabelValues(alerts.StateInvalid).Inc() },
		OnFencedState:     func(int, int64) { m.CEStates.WithLabelValues(alerts.StateFenced).Inc() },
		OnGeneration:      c.OnGeneration, Now: c.Now}, s, s.lg); err != nil {
		return nil, err
	}
	c.States.member.Store(s.member)
	m.SetRebuilding(func() int { return len(s.NotCaughtUp()) })
	m.SetPartitionsOwned(func() int { return len(s.member.Owned()) })
	m.SetBlocked(func() int { return len(s.member.Blocked()) })
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

// Settled is ceshare.Member.Settled: closed once the ledger holds no CE of a partition kept
// from an earlier run that another replica owns, and open again after a pause of the process
// past its session until the next generation released what it lost. Until then this
// replica's follower commits no posterior, its confirmer and reissuer start no batch or
// reissue, and an audit does not start (CaughtUp): each would judge the copies of CEs that
// another replica took over while this one was away, and publish their status changes a
// second time, from a stale copy.
func (s *Share) Settled() <-chan struct{} { return s.member.Settled() }

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
		if err := s.member.JoinError(); err != nil {
			return fmt.Errorf("joining the CE group of %s: %w", s.topic, err)
		}
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
