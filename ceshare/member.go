package ceshare

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/stream"
)

// Hooks is how a Member hands its partitions' requests to the daemon, which keeps them in its
// ledger. The Member calls Acquire, Apply, Lost and Reset from one goroutine per owned
// partition, and Release from one goroutine per release: calls for different partitions may run
// at once, calls for one partition never do.
type Hooks interface {
	// Acquire is called when this replica is given partition p in a new generation (also when
	// it keeps p from the previous one): it returns the offset to read p from, the one the
	// ledger stored with p's last applied requests (0 when it has none), and the Witness stored
	// with it (nil when none).
	Acquire(ctx context.Context, p int) (from int64, w *Witness, err error)
	// Apply stores the requests read from p (in offset order, each with its Offset; records
	// that do not authenticate and copies left out, and none at or after a record that blocks
	// p: Blocked); next is the offset after the last record read (a blocking record's own
	// offset), which the ledger stores with them, in one transaction, with w when it is not
	// nil (a record before next; a Witness stored before stays while it is before the offset
	// stored, and goes when the offset goes back to it or below). reqs may be empty when only
	// records left out were read.
	// At a gap of deleted requests, reqs may instead be registrations rebuilt from CE states
	// (Request.Restored), with next the offset p is at.
	Apply(ctx context.Context, p int, reqs []Request, next int64, w *Witness) error
	// Lost is called when the requests of p from offset `from` (where the ledger holds p) to
	// `to` were deleted from the topic before they were read (its retention is not "for
	// ever"): the ledger stores `to` as p's offset and counts to - from requests lost, in one
	// transaction.
	Lost(ctx context.Context, p int, from, to int64) error
	// Release is called when p is no longer this replica's: the next generation does not
	// give it p, no generation came within the session timeout after the last one ended (the
	// group has surely evicted this member), or the store held p from an earlier run
	// (MemberConfig.Held) and the first generation gives p to another member. It is not called
	// when the member stops, for whatever reason: the store keeps its partitions (see Held). It
	// may outlive the generation (MemberConfig.ReleaseWait): ctx is the member's run, with no
	// deadline, and Run returns only once it did, so Release must return when ctx ends.
	Release(ctx context.Context, p int) error
	// Reset is called when partition p ends before the offset the store read it to, or holds
	// another record than a Witness at its offset (the topic was deleted and created again):
	// the requests the store applied are gone from the topic, but for those of the new log an
	// owner that kept p (or crashed, or lost p, before its next check) read on into, all at
	// offsets from `from` on (past the Witness). It must store offset 0 for p and forget the
	// outcomes of p's requests at offsets from `from` on before anything else, so that no
	// request of the new partition is skipped and each is applied again, in order, those read
	// before among them (the old log's requests before `from` keep theirs: a client's retry of
	// one is answered as before); it may send the store's state of p again as requests. The
	// member then reads p from offset 0.
	Reset(ctx context.Context, p int, end, from int64) error
}

// Witness is a record of a partition that the store read: its offset and the SHA-256 of its
// timestamp, key and value (witnessOf). A partition whose record at Offset hashes otherwise is
// another log than the one the store read: the topic was deleted and created again, and the new
// partition has grown past Offset.
// A member checks the store's Witness when it acquires a partition (sameLog), so that an owner
// that was down, or slow, while that happened does not read on from its offset in the new log;
// and, while it owns the partition, every MemberConfig.WitnessEvery it checks the last record it
// had read at the check before (the store's Witness until it read one), so that an owner that
// keeps the partition and reads on into the new log finds it too. The Witness it hands to Apply
// is that record too, never one read since the last check: an owner that read into a new log
// and then lost the partition, or crashed, before its next check leaves a Witness of the old
// log, which the next acquisition checks.
type Witness struct {
	Offset int64
	Hash   [sha256.Size]byte
}

// witnessOf is r's Witness.
func witnessOf(r record) Witness {
	h := sha256.New()
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(r.time.UnixMilli()))
	h.Write(b[:])
	binary.BigEndian.PutUint64(b[:], uint64(len(r.key)))
	h.Write(b[:])
	h.Write(r.key)
	h.Write(r.value)
	w := Witness{Offset: r.offset}
	h.Sum(w.Hash[:0])
	return w
}

// MemberConfig configures a Member.
type MemberConfig struct {
	Conn stream.ConnConfig
	// Topic is the CE topic (replication.ce_topic). Required.
	Topic string
	// StateTopic is the CE state topic (StateTopic of Topic on a replica), created compacted with
	// Partitions partitions when missing. When set, the member claims each partition it acquires
	// afresh there (claim.go): before the partition's requests are read, it reads the partition
	// of the state topic to its end, writes its claim and reads on to the end (the claims
	// alone when nothing is to replay: the states are not needed). A partition
	// acquired with registrations to replay (from offset 0, or from the offset a rebuild cut
	// short by a crash stored) is given the states its previous owners wrote: each registration
	// it then hands to Apply until the partition caught up carries its CE's state
	// (Request.State). When a partition acquired from offset 0 finds its first requests
	// deleted before any were read (a CE topic given a retention), each state is handed to
	// Apply, before the gap is stored, as a registration rebuilt from it (Request.Restored):
	// the CEs those requests registered come back from their states, and the requests read
	// after the gap apply to them as they did at the previous owner. Empty: none.
	StateTopic string
	// Group is the consumer group that shares the topic's partitions out
	// (<kafka.group_id>.ce). Required.
	Group string
	// Partitions is the topic's partition count (replication.ce_partitions): the topic is
	// created with it when missing, and an existing topic with another count is refused.
	// Required.
	Partitions int
	// Keys are the cluster's keys (replication.key_file): a record whose authenticator does not
	// verify under them is left out, counted (MemberStats.Skipped, ReasonUnauthenticated) and
	// logged at WARN. Required.
	Keys *clusterkey.Keyring
	// OnUnauthenticated, when set, is called for each record of topic (the CE topic or the CE
	// state topic) left out because it does not authenticate, or, on the CE topic, because it
	// is a copy (a signed value whose authenticator is not for where it was written: see
	// Blocked) (the daemon counts them in a metric); and, with topic GroupSource(Group), partition and offset -1, once for each member
	// of the group whose data does not authenticate, when this member leads a rebalance (that
	// member is given no partition).
	OnUnauthenticated func(topic string, partition int, offset int64)
	// Skip names records that block their partition (Blocked) and are to be skipped instead
	// (replication.skip_ce_requests: no build of the cluster reads them). What they hold is
	// lost; each is logged at WARN, counted in MemberStats.Skipped and handed to OnSkip. Records
	// a rule names that this build reads are applied as any. Default: none.
	Skip []Skip
	// OnSkip, when set, is called for each record left out because Skip names it (the daemon
	// counts them in a metric).
	OnSkip func(partition int, offset int64)
	// Readable, when set, says whether this build reads all of a request that Decode accepted
	// from an authenticated record (the CE a registration carries is opaque here): an error
	// blocks the partition at the request (Blocked, ReasonCE), as a record Decode refuses does.
	Readable func(Request) error
	// OnMalformedState, when set, is called for each authenticated record of the CE state topic
	// left out because it is not a State.
	OnMalformedState func(partition int, offset int64)
	// OnFencedState, when set, is called for each state of the CE state topic written by a
	// replica that did not own the partition then (StateStats.Fenced).
	OnFencedState func(partition int, offset int64)
	// OnGeneration, when set, is called with each generation's assignment before the member
	// takes it up (releases the partitions it lost, acquires those it gained), and holds the
	// member until it returns: a test holds a member there, as a slow process is held.
	OnGeneration func(ctx context.Context, generation int32, assigned []int)
	// ReplicaID names this replica to the others (replication.replica_id). Required.
	ReplicaID string
	// AdvertiseURL is where the other replicas reach this one's API
	// (replication.advertise_url). Required.
	AdvertiseURL string
	// SessionTimeout is how long the group waits for a silent member before it gives the
	// member's partitions to the others (replication.session_timeout). Default: 10s.
	SessionTimeout time.Duration
	// HeartbeatInterval is how often the member heartbeats; a rebalance is noticed at the
	// next heartbeat (replication.heartbeat_interval). It must be below SessionTimeout.
	// Default: 1s.
	HeartbeatInterval time.Duration
	// RebalanceTimeout is how long the coordinator waits for the members to rejoin in a
	// rebalance. Default: SessionTimeout.
	RebalanceTimeout time.Duration
	// JoinBackoff is the wait before joining again after a failed join. Default: 1s.
	JoinBackoff time.Duration
	// FetchWait is how long a fetch waits for new requests at a partition's end; it bounds
	// how long a partition's loop takes to notice the generation's end.
	// Default: 500ms.
	FetchWait time.Duration
	// FetchMaxBytes bounds one fetch. Default: 1 MiB.
	FetchMaxBytes int
	// MaxBatch bounds the requests of one Apply. Default: 1000.
	MaxBatch int
	// RetryMin and RetryMax bound the backoff between failed fetches. Defaults: 50ms, 5s.
	RetryMin, RetryMax time.Duration
	// WitnessEvery is how often the member checks, for each partition it owns, that the
	// partition still holds the last record it had read at the check before (the store's
	// Witness until it read one): a topic deleted and created again while the member owns the
	// partition, and grown past its offset, is found at the first check after the member read
	// into the new log. It costs one fetch of one batch per owned partition that has a Witness.
	// Default: 10s, as the posterior log's check of its head.
	WitnessEvery time.Duration
	// ReleaseWait bounds how long a generation waits for its releases (Hooks.Release) before it
	// takes up its partitions; releases still running then go on in the background. Default:
	// 10s.
	ReleaseWait time.Duration
	// Held is the partitions the store still holds from an earlier run (a stop that kept them,
	// or a crash). The member asks the group for them back (the sticky balancer keeps them with
	// it unless another member took them over meanwhile); those its first generation does not
	// give it belong to other members by now and are released (Hooks.Release) when that
	// generation starts. Default: none.
	Held []int

	// dial, when set, replaces the member's dialing (tests cut a member off the broker).
	dial func(ctx context.Context, network, address string) (net.Conn, error)
	// decode is Decode, or what a test sets to play a build that reads another format.
	decode func(key, value []byte) (Request, error)
	// beforeFetch, when set, is called before each fetch of a partition's requests, with the
	// offset it reads from (a test holds a partition's read there).
	beforeFetch func(p int, next int64)
}

func (c *MemberConfig) applyDefaults() error {
	switch {
	case c.Topic == "":
		return errors.New("ceshare: the CE topic (replication.ce_topic) is empty")
	case c.Group == "":
		return errors.New("ceshare: the CE group (kafka.group_id + \".ce\") is empty")
	case c.Partitions < 1:
		return fmt.Errorf("ceshare: replication.ce_partitions %d: want at least 1", c.Partitions)
	case c.ReplicaID == "":
		return errors.New("ceshare: replication.replica_id is empty")
	case c.Keys == nil:
		return errors.New("ceshare: no cluster key (replication.key_file)")
	case c.AdvertiseURL == "":
		return errors.New("ceshare: replication.advertise_url is empty")
	}
	c.SessionTimeout = cmp.Or(c.SessionTimeout, 10*time.Second)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, time.Second)
	c.RebalanceTimeout = cmp.Or(c.RebalanceTimeout, c.SessionTimeout)
	c.JoinBackoff = cmp.Or(c.JoinBackoff, time.Second)
	c.FetchWait = cmp.Or(c.FetchWait, 500*time.Millisecond)
	c.FetchMaxBytes = cmp.Or(c.FetchMaxBytes, 1<<20)
	c.MaxBatch = cmp.Or(c.MaxBatch, 1000)
	c.RetryMin = cmp.Or(c.RetryMin, 50*time.Millisecond)
	c.RetryMax = cmp.Or(c.RetryMax, 5*time.Second)
	c.ReleaseWait = cmp.Or(c.ReleaseWait, 10*time.Second)
	c.WitnessEvery = cmp.Or(c.WitnessEvery, 10*time.Second)
	if c.decode == nil {
		c.decode = Decode
	}
	if c.HeartbeatInterval <= 0 || c.HeartbeatInterval >= c.SessionTimeout {
		return fmt.Errorf("ceshare: replication.heartbeat_interval %v must be positive and below replication.session_timeout %v",
			c.HeartbeatInterval, c.SessionTimeout)
	}
	for name, d := range map[string]time.Duration{"RebalanceTimeout": c.RebalanceTimeout, "JoinBackoff": c.JoinBackoff,
		"FetchWait": c.FetchWait, "RetryMin": c.RetryMin, "RetryMax": c.RetryMax, "ReleaseWait": c.ReleaseWait,
		"WitnessEvery": c.WitnessEvery} {
		if d < 0 {
			return fmt.Errorf("ceshare: %s %v must be positive", name, d)
		}
	}
	if c.FetchMaxBytes < 0 || c.MaxBatch < 0 {
		return fmt.Errorf("ceshare: FetchMaxBytes %d and MaxBatch %d must be positive", c.FetchMaxBytes, c.MaxBatch)
	}
	return nil
}

// MemberStats is a snapshot of a Member's counters.
type MemberStats struct {
	Generations int64            // generations this member took part in
	Applied     int64            // requests handed to Apply
	Skipped     map[string]int64 // records left out (not authenticated, copies, or named in MemberConfig.Skip), by DecodeError.Reason
	Lost        int64            // times the member released everything after no generation came in time
	Gaps        int64            // requests deleted (by retention) before they were read, counted lost (Hooks.Lost)
	Restored    int64            // registrations rebuilt from CE states at such a gap (Request.Restored), handed to Apply
	States      StateStats       // what was read of the CE state topic
	Checks      int64            // fetches of a Witness's record: at acquisitions, and every MemberConfig.WitnessEvery per owned partition
}

// partState is what the member knows of a partition it acquired.
type partState struct {
	next  int64     // offset after the last record handed to Apply (or from Acquire)
	end   int64     // the partition's high watermark at the last fetch
	ready bool      // next reached end once since Acquire
	since time.Time // when the partition was acquired
	// states are the CE states read from the state topic when the partition was acquired with
	// registrations to replay, handed to them until the partition caught up.
	states map[string]State
	// ownedBefore: the state topic holds a claim of the partition older than this member's
	// acquisition (an earlier owner read it).
	ownedBefore bool
	// blocked is the record at next that this member cannot read, nil while there is none.
	blocked *Blocked
}

// Blocked is a partition whose next record this member cannot read: it authenticates under the
// cluster's keys, so a member of the cluster signed it, but it does not decode as a Request of
// this build (most likely a newer build's format, during a rolling upgrade). Skipping it would
// lose what a replica acknowledged, so the member applies nothing at or after it, and its store
// keeps the record's offset as the partition's: a cfguard that reads it (this replica upgraded,
// or the partition's next owner) applies it and what follows it. Meanwhile the partition is not
// ready (Ready), as one being rebuilt is. A copy (a signed value under another record's key, in
// another partition than its id's, or naming no id) is no such record: anyone who can write the
// topic can make one, and it is skipped. A replay of a signed request into its own partition
// under its own key is that request again (so is a producer's retry): it blocks, as the request
// does. MemberConfig.Skip names records to skip instead.
type Blocked struct {
	Partition int
	Offset    int64
	ID        string    // the CE id the record names (its key)
	Reason    string    // why Decode refused it (DecodeError.Reason), ReasonCE for MemberConfig.Readable
	Detail    string    // Decode's detail
	Writer    string    // the replica the record names (its "replica" field), "" when none can be read
	Since     time.Time // when this member found it at the partition's offset
}

// Member is one replica's membership of the CE group: it owns the partitions the group
// assigns it, and hands their requests to Hooks. See the package documentation.
type Member struct {
	cfg   MemberConfig
	hooks Hooks
	log   *slog.Logger
	bal   *stickyBalancer

	running atomic.Bool

	mu          sync.Mutex
	parts       map[int]*partState    // acquired and not released
	generation  int32                 // the live generation, 0 between generations
	lastGen     int32                 // the latest generation the member took part in
	memberID    string                // its member id in lastGen
	releasing   map[int]chan struct{} // releases still running (closed when each ends)
	releases    sync.WaitGroup        // the goroutines of releasing, waited for by Run
	states      StateStats
	generations int64
	applied     int64
	skipped     map[string]int64
	lost, gaps  int64
	restored    int64
	checks      int64
	held        []int // Held, until the first generation releases those it does not assign
}

// NewMember checks cfg, creates the CE topic when it is missing (with cfg.Partitions
// partitions, kept for ever) and refuses one with another partition count. The member joins
// the group in Run.
func NewMember(ctx context.Context, cfg MemberConfig, hooks Hooks, log *slog.Logger) (*Member, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if hooks == nil {
		return nil, errors.New("ceshare: NewMember: nil Hooks")
	}
	if err := cfg.applyDefaults(); err != nil {
		return nil, err
	}
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	tr, err := cfg.transport(tctx)
	if err != nil {
		return nil, err
	}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(cfg.Conn.Brokers...), Transport: tr}
	created, err := ensureTopic(ctx, cl, cfg.Topic, cfg.Partitions)
	if err != nil {
		return nil, err
	}
	log = log.With("topic", cfg.Topic, "group", cfg.Group, "replica", cfg.ReplicaID)
	if created {
		log.Info("CE topic created", "partitions", cfg.Partitions)
	}
	if cfg.StateTopic != "" {
		if created, err = ensureStateTopic(ctx, cl, cfg.StateTopic, cfg.Partitions); err != nil {
			return nil, err
		}
		if created {
			log.Info("CE state topic created", "state_topic", cfg.StateTopic, "partitions", cfg.Partitions)
		}
	}
	skipped := make(map[string]int64)
	for _, r := range Reasons() {
		skipped[r] = 0
	}
	m := &Member{cfg: cfg, hooks: hooks, log: log, parts: map[int]*partState{}, skipped: skipped, held: slices.Clone(cfg.Held),
		releasing: map[int]chan struct{}{},
		bal:       &stickyBalancer{topic: cfg.Topic, replica: cfg.ReplicaID, url: cfg.AdvertiseURL, owned: slices.Clone(cfg.Held), keys: cfg.Keys}}
	m.bal.refused = func(member string, err error) {
		log.Warn("a member of the CE group whose data does not authenticate under the cluster key was given no partition: "+
			"a client without replication.key_file joined the group (check the group's ACLs), or this replica's key file "+
			"lacks the key that member signs with (keys rotated out of order: every replica must hold every key in use)",
			"member", member, "err", err)
		if cfg.OnUnauthenticated != nil {
			cfg.OnUnauthenticated(GroupSource(cfg.Group), -1, -1)
		}
	}
	return m, nil
}

// GroupOf is the CE group of the replicas whose consumer group is groupID (kafka.group_id).
func GroupOf(groupID string) string { return groupID + ".ce" }

// GroupSource is the source OnUnauthenticated names for the member data of group: "group:"
// and its name (a CE group and the CE topic may share a name).
func GroupSource(group string) string { return "group:" + group }

func (c *MemberConfig) transport(ctx context.Context) (*kafka.Transport, error) {
	tr, err := c.Conn.Transport(ctx)
	if err == nil && c.dial != nil {
		tr.Dial = c.dial
	}
	return tr, err
}

func (c *MemberConfig) dialer() (*kafka.Dialer, error) {
	d, err := c.Conn.Dialer()
	if err == nil && c.dial != nil {
		d.DialFunc = c.dial
	}
	return d, err
}

// Owned returns the partitions this member holds (acquired and not released), in order.
// Between generations it still holds the partitions of the last one.
func (m *Member) Owned() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Sorted(maps.Keys(m.parts))
}

// Assigned returns the partitions the current generation assigned to this member (those of
// the last generation between two), before each is acquired.
func (m *Member) Assigned() []int {
	m.bal.mu.Lock()
	defer m.bal.mu.Unlock()
	return slices.Clone(m.bal.owned)
}

// Releasing returns the partitions whose release still runs (MemberConfig.ReleaseWait), sorted:
// the store still holds some of their CEs, which other members own.
func (m *Member) Releasing() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Sorted(maps.Keys(m.releasing))
}

// Ready reports whether this member holds p, has applied p's requests up to the partition's
// end at least once since it acquired p, and is not blocked at a record it cannot read.
func (m *Member) Ready(p int) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	ps := m.parts[p]
	return ps != nil && ps.ready && ps.blocked == nil
}

// Blocked returns the partitions this member holds that are blocked at a record it cannot read,
// sorted by partition.
func (m *Member) Blocked() []Blocked {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []Blocked
	for _, ps := range m.parts {
		if ps.blocked != nil {
			out = append(out, *ps.blocked)
		}
	}
	slices.SortFunc(out, func(a, b Blocked) int { return cmp.Compare(a.Partition, b.Partition) })
	return out
}

// Next returns the offset after the last request of p handed to Apply, and whether the member
// holds p.
func (m *Member) Next(p int) (int64, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	ps := m.parts[p]
	if ps == nil {
		return 0, false
	}
	return ps.next, true
}

// Generation returns the group generation the member takes part in, 0 between generations.
func (m *Member) Generation() int32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.generation
}

// LastGeneration returns the latest generation the member took part in (the live one, or the
// one that ended last), 0 before the first.
func (m *Member) LastGeneration() int32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lastGen
}

// Stats returns a snapshot of the member's counters.
func (m *Member) Stats() MemberStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return MemberStats{Generations: m.generations, Applied: m.applied, Skipped: maps.Clone(m.skipped), Lost: m.lost, Gaps: m.gaps, Restored: m.restored,
		States: m.states, Checks: m.checks}
}

// Run joins the group and serves the partitions of each generation until ctx ends, then
// leaves the group; it releases nothing then (the store keeps its partitions: see Held), and
// returns once the releases of partitions given to others have stopped. It returns nil when
// ctx ended, or the error
// that stopped it (a hook's error, a partition whose stored offset is past its end, a
// configuration error no retry fixes). Run may be called once.
func (m *Member) Run(ctx context.Context) error {
	if !m.running.CompareAndSwap(false, true) {
		return errors.New("ceshare: Member.Run called twice")
	}
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	dialer, err := m.cfg.dialer()
	if err != nil {
		return err
	}
	tr, err := m.cfg.transport(ctx)
	if err != nil {
		return err
	}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(m.cfg.Conn.Brokers...), Transport: tr}
	debug := kafka.LoggerFunc(func(msg string, args ...any) { m.log.Debug("kafka-go: " + fmt.Sprintf(msg, args...)) })
	cg, err := kafka.NewConsumerGroup(kafka.ConsumerGroupConfig{
		ID: m.cfg.Group, Brokers: m.cfg.Conn.Brokers, Dialer: dialer, Topics: []string{m.cfg.Topic},
		GroupBalancers:    []kafka.GroupBalancer{m.bal},
		HeartbeatInterval: m.cfg.HeartbeatInterval, SessionTimeout: m.cfg.SessionTimeout,
		RebalanceTimeout: m.cfg.RebalanceTimeout, JoinGroupBackoff: m.cfg.JoinBackoff,
		Timeout: m.cfg.Conn.DialTimeout, Logger: debug, ErrorLogger: debug,
	})
	if err != nil {
		return fmt.Errorf("ceshare: group %q: %w", m.cfg.Group, err)
	}
	// The group is closed as soon as ctx ends, before the generation's functions return:
	// kafka-go then leaves the group instead of joining the next generation.
	left := make(chan struct{})
	go func() {
		<-ctx.Done()
		cg.Close()
		close(left)
	}()
	m.log.Info("joining the CE group", "session_timeout", m.cfg.SessionTimeout, "heartbeat_interval", m.cfg.HeartbeatInterval)
	ended := time.Now()
	failures := 0
	for ctx.Err() == nil {
		gen, err := m.next(ctx, cg, ended)
		if err != nil {
			switch {
			case ctx.Err() != nil:
			case !stream.Retryable(err):
				fail(fmt.Errorf("ceshare: joining group %q: %w", m.cfg.Group, err))
			case errors.Is(err, kafka.RebalanceInProgress): // the usual first answer to a join
				m.log.Debug("the CE group is rebalancing; joining again", "err", err)
				continue
			case errors.Is(err, kafka.InconsistentGroupProtocol) && failures%30 == 0:
				m.log.Warn("the CE group holds members that offer another group protocol than "+protocolName+
					" (another cfguard build, older or newer): this replica joins once they are gone; stop every replica of "+
					"the other build", "err", err, "failures", failures+1)
			case failures%30 == 0:
				m.log.Warn("joining the CE group failed; retrying", "err", err, "failures", failures+1)
			}
			failures++
			continue
		}
		failures = 0
		m.serve(ctx, cl, gen, fail)
		ended = time.Now()
	}
	<-left
	m.releases.Wait() // ctx ended: each stops where it is, and a restart releases it again (Held)
	// Not released: the store keeps what it holds, so that a restart given it back resumes
	// from its offsets, and a restart that is not releases it then (MemberConfig.Held). A
	// member that stops because it failed (a hook's error) must not empty the store either.
	m.forgetAll()
	if err := context.Cause(ctx); !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// next waits for the next generation. A member that holds partitions and gets no generation
// within the session timeout after the last one ended was evicted by the group (it could
// not heartbeat): it releases everything, since other members own them by now.
func (m *Member) next(ctx context.Context, cg *kafka.ConsumerGroup, ended time.Time) (*kafka.Generation, error) {
	if len(m.Owned()) == 0 {
		return cg.Next(ctx)
	}
	tctx, cancel := context.WithDeadline(ctx, ended.Add(m.cfg.SessionTimeout))
	defer cancel()
	gen, err := cg.Next(tctx)
	if err != nil && ctx.Err() == nil && tctx.Err() != nil {
		m.mu.Lock()
		m.lost++
		m.mu.Unlock()
		m.releaseAll(ctx, "no generation within the session timeout: the group evicted this member")
		return cg.Next(ctx)
	}
	return gen, err
}

// serve runs one generation: it releases the partitions it lost, then reads each assigned
// partition in its own goroutine until the generation ends. It returns once they all stopped.
func (m *Member) serve(ctx context.Context, cl *kafka.Client, gen *kafka.Generation, fail context.CancelCauseFunc) {
	var assigned []int
	for _, pa := range gen.Assignments[m.cfg.Topic] {
		assigned = append(assigned, pa.ID)
	}
	slices.Sort(assigned)
	if m.cfg.OnGeneration != nil {
		m.cfg.OnGeneration(ctx, gen.ID, assigned)
	}
	var releases []chan struct{}
	for _, p := range m.Owned() {
		if !slices.Contains(assigned, p) {
			releases = append(releases, m.release(ctx, p, "assigned to another member"))
		}
	}
	m.mu.Lock()
	if m.lastGen != 0 && gen.ID != m.lastGen+1 && gen.MemberID != m.memberID && len(m.parts) > 0 {
		// A generation went by without this member: it left the group (its new member id:
		// evicted after a pause past its session, or the group started again), so another
		// member may have owned and claimed what it kept. Each is acquired afresh, claimed
		// again, with its states read anew; the store keeps what it holds. (A generation that
		// no member took up, its sync cut by another rebalance, leaves the member id as it was.)
		m.log.Warn("CE group generations went by without this member: claiming its partitions again",
			"last_generation", m.lastGen, "generation", gen.ID, "partitions", slices.Sorted(maps.Keys(m.parts)))
		clear(m.parts)
	}
	m.memberID = gen.MemberID
	held := m.held
	m.held = nil
	m.mu.Unlock()
	for _, p := range held {
		if !slices.Contains(assigned, p) {
			releases = append(releases, m.startRelease(ctx, p, "held from an earlier run, assigned to another member"))
		}
	}
	m.awaitReleases(releases)
	m.bal.setOwned(assigned, gen.ID)
	m.mu.Lock()
	m.generation, m.lastGen = gen.ID, gen.ID
	m.generations++
	m.mu.Unlock()
	m.log.Info("CE group generation", "generation", gen.ID, "member", gen.MemberID, "partitions", assigned)
	done := make(chan struct{})
	gen.Start(func(gctx context.Context) {
		defer close(done)
		var wg sync.WaitGroup
		for _, p := range assigned {
			wg.Go(func() { m.readPartition(gctx, cl, p, gen.ID, fail) })
		}
		wg.Wait()
		// A member without partitions (or whose loops failed) stays in the generation until
		// it ends: returning would end it for the whole group.
		<-gctx.Done()
	})
	<-done
	m.mu.Lock()
	m.generation = 0
	m.mu.Unlock()
}

// readPartition acquires p (given to the member in generation gen) and hands its requests to
// Apply, batch by batch, until ctx (the generation) ends. An error no retry fixes stops the
// member through fail.
func (m *Member) readPartition(ctx context.Context, cl *kafka.Client, p int, gen int32, fail context.CancelCauseFunc) {
	m.mu.Lock()
	releasing := m.releasing[p]
	m.mu.Unlock()
	if releasing != nil { // given back while its release still runs: acquired once it ended
		m.log.Info("CE partition given back while its release runs: acquired once the release ends", "partition", p)
		select {
		case <-releasing:
		case <-ctx.Done():
			return
		}
	}
	from, witness, err := m.hooks.Acquire(ctx, p)
	if err != nil {
		if ctx.Err() == nil {
			fail(fmt.Errorf("ceshare: acquiring partition %d of %q: %w", p, m.cfg.Topic, err))
		}
		return
	}
	if from < 0 {
		fail(fmt.Errorf("ceshare: acquiring partition %d of %q: Acquire returned offset %d", p, m.cfg.Topic, from))
		return
	}
	m.mu.Lock()
	ps := m.parts[p]
	fresh := ps == nil || ps.next != from
	if fresh {
		ps = &partState{next: from, since: time.Now()}
		m.parts[p] = ps
		m.log.Info("CE partition acquired", "partition", p, "from", from)
	}
	m.mu.Unlock()
	// A partition acquired afresh is claimed. The registrations still to replay get their
	// states: all of them when the partition is acquired from its start, the rest of them when
	// a rebuild was cut short (a crash).
	if fresh && m.cfg.StateTopic != "" {
		replay := m.toReplay(ctx, cl, p, from)
		states, before := m.acquireStates(ctx, cl, p, gen, replay)
		if ctx.Err() != nil {
			return
		}
		m.mu.Lock()
		ps.ownedBefore = before
		m.mu.Unlock()
		if replay {
			m.mu.Lock()
			if !ps.ready {
				ps.states = states
			}
			m.mu.Unlock()
			m.log.Info("CE states of the partition read", "partition", p, "states", len(states))
		}
	}
	bo := backoff.Backoff{Min: m.cfg.RetryMin, Max: m.cfg.RetryMax}
	blockedBo := bo // between reads of a record this build cannot read
	var failing fetchFailures
	// retry counts a failed read of p and waits out the backoff: false when ctx ended meanwhile.
	retry := func(err error) bool {
		failing.failed(m.log, time.Now(), p, err)
		return bo.Wait(ctx) == nil
	}
	next := from
	if witness != nil && witness.Offset >= from {
		witness = nil // not a record before the offset: nothing to check
	}
	// While p is owned, the last record read as of a check (seen) is the witness of the next
	// one: once an owner reads on into a new log, its last record is of that log, but the one
	// it had read at the check before is of the old one. It starts as the store's Witness (an
	// idle partition's is checked again at each check), or as the first record read when there
	// is none; and it is the Witness Apply stores, so that the store's Witness, checked at the
	// next acquisition (a new generation, a restart after a crash), is never a record read since
	// the last check. Both are forgotten where next goes back (a reset): they are records of a
	// log read no more.
	seen, last := witness, witness
	checked := time.Now()
	for ctx.Err() == nil {
		if witness == nil && time.Since(checked) >= m.cfg.WitnessEvery {
			witness, seen, checked = seen, last, time.Now()
			if witness != nil && witness.Offset >= next {
				witness = nil
			}
		}
		if witness != nil { // first: is the partition still the log the store read?
			m.mu.Lock()
			m.checks++
			m.mu.Unlock()
			other, end, err := m.sameLog(ctx, cl, p, *witness)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if !stream.Retryable(err) && !errors.Is(err, errRecords) {
					fail(fmt.Errorf("ceshare: reading partition %d of %q: %w", p, m.cfg.Topic, err))
					return
				}
				if !retry(err) {
					return
				}
				continue
			}
			bo.Reset()
			failing.worked(m.log, time.Now(), p)
			if other {
				m.log.Error("CE partition holds another record than the one this replica read at its offset: the topic was deleted and "+
					"created again and has grown past what this replica read; its requests are gone, the partition is read again from "+
					"offset 0 and this replica's CEs of it are sent again", "partition", p, "offset", witness.Offset, "read_to", next, "end", end)
				if next, err = m.reset(ctx, p, next, end, witness.Offset+1); err != nil {
					if ctx.Err() == nil {
						fail(err)
					}
					return
				}
				seen, last = nil, nil
			}
			witness = nil
		}
		if m.cfg.beforeFetch != nil {
			m.cfg.beforeFetch(p, next)
		}
		res, err := cl.Fetch(ctx, &kafka.FetchRequest{Topic: m.cfg.Topic, Partition: p, Offset: next,
			MinBytes: 1, MaxBytes: int64(m.cfg.FetchMaxBytes), MaxWait: m.cfg.FetchWait})
		if err == nil && res.Error != nil {
			err = res.Error
		}
		if errors.Is(err, kafka.OffsetOutOfRange) {
			was := next
			if next, err = m.outOfRange(ctx, cl, p, next); err != nil {
				if ctx.Err() == nil {
					fail(err)
				}
				return
			}
			if next < was {
				seen, last = nil, nil
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !stream.Retryable(err) {
				fail(fmt.Errorf("ceshare: reading partition %d of %q: %w", p, m.cfg.Topic, err))
				return
			}
			m.log.Debug("fetching CE requests failed; retrying", "partition", p, "err", err)
			if !retry(err) {
				return
			}
			continue
		}
		bo.Reset()
		batch, after, lastRead, blocked, err := m.decode(p, res.Records, next)
		if err != nil {
			m.log.Debug("reading fetched CE requests failed; retrying", "partition", p, "err", err)
			if !retry(err) {
				return
			}
			continue
		}
		failing.worked(m.log, time.Now(), p)
		if lastRead != nil {
			last = lastRead
			if seen == nil {
				seen = lastRead
			}
		}
		m.mu.Lock()
		for i := range batch {
			if s, ok := ps.states[batch[i].req.ID]; ok && batch[i].req.Kind == KindRegister {
				batch[i].req.State = &s
			}
		}
		m.mu.Unlock()
		if next, err = m.apply(ctx, p, batch, next, after, seen); err != nil {
			if ctx.Err() == nil {
				fail(fmt.Errorf("ceshare: applying requests of partition %d of %q: %w", p, m.cfg.Topic, err))
			}
			return
		}
		m.mu.Lock()
		ps.end = res.HighWatermark
		if ps.blocked != nil && next > ps.blocked.Offset { // passed: read, or deleted by the topic's retention
			m.log.Info("CE partition no longer blocked", "partition", p, "offset", ps.blocked.Offset, "next", next,
				"blocked_for", time.Since(ps.blocked.Since).Round(time.Millisecond))
			ps.blocked = nil
		}
		if next >= ps.end && !ps.ready {
			ps.ready, ps.states = true, nil
			m.log.Info("CE partition caught up", "partition", p, "next", next, "took", time.Since(ps.since).Round(time.Millisecond))
		}
		m.mu.Unlock()
		if blocked == nil {
			blockedBo.Reset()
			continue
		}
		if next == blocked.Offset {
			// This build reads nothing past it; read it again after a while all the same, as
			// retention may delete it (then the partition's gap is counted lost, as any).
			m.block(p, ps, blocked)
			if blockedBo.Wait(ctx) != nil {
				return
			}
		}
	}
}

// block records that p is blocked at b (Blocked), and says so at ERROR when it was not at
// that offset before.
func (m *Member) block(p int, ps *partState, b *Blocked) {
	m.mu.Lock()
	found := ps.blocked == nil || ps.blocked.Offset != b.Offset
	m.mu.Unlock()
	if !found {
		return
	}
	// Published after it is logged: who sees the block finds its line.
	defer func() {
		m.mu.Lock()
		b.Since = time.Now()
		ps.blocked = b
		m.mu.Unlock()
	}()
	m.log.Error("CE partition blocked at a request this build cannot read: nothing at or after it is applied, and its "+
		"registrations answer 202, until a cfguard that reads it owns the partition (upgrade this replica to the build "+
		"of the replica that wrote it) or replication.skip_ce_requests names it", "partition", p, "offset", b.Offset, "id", b.ID, "writer", b.Writer, "reason", b.Reason, "detail", b.Detail)
}

// fetchWarnAfter is how long the fetches of a partition fail in a row before the member says so
// at WARN, once per episode: shorter episodes, such as a partition's leader moving, stay at
// DEBUG. A partition being rebuilt stays so until a fetch works again
// (cfguard_counterfactuals_partitions_rebuilding, alert CfguardCounterfactualsNotCaughtUp).
const fetchWarnAfter = 10 * time.Second

// fetchFailures is one partition's episode of failed reads, for its log lines: of its requests
// (fetches, or fetched records that do not decode; the zero value), or of its CE states
// (stateFailures).
type fetchFailures struct {
	since   time.Time // the episode's first failure; zero while reads work
	warned  bool
	failing string // the WARN line's message; "" for fetches of requests
	again   string // the INFO line's
}

// stateFailures is the episode of a partition's reads and claim of the CE state topic.
func stateFailures() fetchFailures {
	return fetchFailures{failing: "reading or claiming the CE states of a partition keeps failing; retrying (the partition is not caught up until it works)",
		again: "CE states of the partition read and claimed again"}
}

// failed records a failure at now, and logs at WARN when the episode reaches fetchWarnAfter.
func (f *fetchFailures) failed(log *slog.Logger, now time.Time, p int, err error) {
	if f.since.IsZero() {
		f.since = now
	}
	if failing := now.Sub(f.since); !f.warned && failing >= fetchWarnAfter {
		f.warned = true
		log.Warn(cmp.Or(f.failing, "fetching CE requests of a partition keeps failing; retrying (a partition not caught up stays so until a fetch works)"),
			"partition", p, "failing_for", failing.Round(time.Millisecond), "err", err)
	}
}

// worked ends the episode at now, saying so when it was logged at WARN.
func (f *fetchFailures) worked(log *slog.Logger, now time.Time, p int) {
	if f.warned {
		log.Info(cmp.Or(f.again, "fetching CE requests of the partition works again"), "partition", p, "failed_for", now.Sub(f.since).Round(time.Millisecond))
	}
	f.since, f.warned = time.Time{}, false
}

// toReplay says whether partition p of the CE topic holds records at or after from (true when
// its end cannot be read: reading the states costs a read, missing them costs the states).
func (m *Member) toReplay(ctx context.Context, cl *kafka.Client, p int, from int64) bool {
	if from == 0 {
		return true
	}
	_, end, err := partitionOffsets(ctx, cl, m.cfg.Topic, p)
	return err != nil || end > from
}

// acquireStates claims partition p of the CE state topic for generation gen and, with restore,
// reads its states, and says whether an earlier owner claimed p (claimStates). A broker's
// transient errors are retried for as long as they last, as fetches of the CE topic are: the
// partition stays not caught up meanwhile (cfguard_counterfactuals_partitions_rebuilding,
// CfguardCounterfactualsNotCaughtUp), with a WARN line once the episode reaches fetchWarnAfter.
// Rebuilding without the states would lose the previous owner's renewals, verdicts and history,
// and leave p unclaimed, so that the next owner would take this replica's states for late
// writes. A state topic that is gone is created again. Any other error (ACLs, records that do
// not decode) is logged at ERROR and the partition is rebuilt from its registrations alone.
func (m *Member) acquireStates(ctx context.Context, cl *kafka.Client, p int, gen int32, restore bool) (map[string]State, bool) {
	bo := backoff.Backoff{Min: m.cfg.RetryMin, Max: m.cfg.RetryMax}
	failing := stateFailures()
	for {
		states, before, err := m.claimStates(ctx, cl, p, gen, restore)
		if err == nil {
			failing.worked(m.log, time.Now(), p)
			return states, before
		}
		if ctx.Err() != nil {
			return nil, false
		}
		transient := stream.Transient(err)
		if topicGone(err) {
			created, cerr := createStateTopic(ctx, cl, m.cfg.StateTopic, m.cfg.Partitions)
			if created {
				m.log.Warn("CE state topic was gone and is created again: the states it held are lost", "state_topic", m.cfg.StateTopic)
			}
			transient = cerr == nil || stream.Transient(cerr) // read it again (as created now), or create it again
			err = errors.Join(err, cerr)
		}
		if !transient {
			m.log.Error("CE state topic cannot be read or the partition claimed there: its CEs are rebuilt from their registrations, "+
				"without the renewals, verdicts and history of their previous owner, and the partition's next owner may take the "+
				"states this replica writes for them for a previous owner's late writes", "partition", p, "state_topic", m.cfg.StateTopic, "err", err)
			return nil, false
		}
		failing.failed(m.log, time.Now(), p, err)
		m.log.Debug("reading or claiming CE states failed; retrying", "partition", p, "err", err)
		if bo.Wait(ctx) != nil {
			return nil, false
		}
	}
}

// offsetRequest is a decoded request and its offset.
type offsetRequest struct {
	req    Request
	offset int64
}

// record is one data record of a fetch response: its offset, key, value and authenticator
// (the clusterkey.Header header, nil without one).
type record struct {
	offset     int64
	time       time.Time // the record's timestamp
	key, value []byte
	auth       []byte
}

// eachRecord calls fn with each data record of rr at or after from (a batch may start before
// the offset asked for) and returns the offset after the last record, control records included.
func eachRecord(rr kafka.RecordReader, from int64, fn func(r record)) (next int64, err error) {
	next = from
	err = stream.EachRecord(rr, func(r *kafka.Record, control bool) error {
		if r.Offset < from {
			return nil
		}
		next = max(next, r.Offset+1)
		if control {
			return nil
		}
		rec := record{offset: r.Offset, time: r.Time}
		var err error
		if rec.key, err = stream.ReadBytes(r.Key); err != nil {
			return err
		}
		if rec.value, err = stream.ReadBytes(r.Value); err != nil {
			return err
		}
		for _, h := range r.Headers {
			if h.Key == clusterkey.Header {
				rec.auth = h.Value
			}
		}
		fn(rec)
		return nil
	})
	return next, err
}

// decode reads the records of a fetch response at or after from. It returns the well-formed
// requests, the offset after the last record and the Witness of the last record before it;
// records that do not authenticate and copies are counted and logged. At a record that blocks p
// (Blocked) it stops: it returns the requests before it, its offset as the offset after them,
// and what blocks p.
func (m *Member) decode(p int, rr kafka.RecordReader, from int64) ([]offsetRequest, int64, *Witness, *Blocked, error) {
	var out []offsetRequest
	var blocked *Blocked
	var last *record // the last record read, not stopped at: its Witness is hashed once, at the end
	next, err := eachRecord(rr, from, func(r record) {
		if blocked != nil {
			return
		}
		defer func() {
			if blocked == nil {
				last = &r
			}
		}()
		if err := Authenticate(m.cfg.Keys, r.value, r.auth); err != nil {
			// The line before the counts, so that whoever sees a count (an alert, a test) finds it.
			m.log.Warn("unauthenticated CE request ignored: a writer without the cluster key (replication.key_file) wrote to the CE topic; check its ACLs",
				"partition", p, "offset", r.offset, "err", err)
			m.mu.Lock()
			m.skipped[ReasonUnauthenticated]++
			m.mu.Unlock()
			if m.cfg.OnUnauthenticated != nil {
				m.cfg.OnUnauthenticated(m.cfg.Topic, p, r.offset)
			}
			return
		}
		req, err := m.cfg.decode(r.key, r.value)
		if err == nil && Partition(req.ID, m.cfg.Partitions) != p {
			err = &DecodeError{Reason: ReasonPartition, Detail: fmt.Sprintf("id %q belongs to partition %d", req.ID, Partition(req.ID, m.cfg.Partitions))}
		}
		if err == nil && m.cfg.Readable != nil {
			if rerr := m.cfg.Readable(req); rerr != nil {
				blocked = m.blockOrSkip(&Blocked{Partition: p, Offset: r.offset, ID: clip([]byte(req.ID)), Reason: ReasonCE, Detail: rerr.Error(), Writer: clip([]byte(req.Replica))})
				return
			}
		}
		var de *DecodeError
		if errors.As(err, &de) {
			if b := m.blocks(p, r, de); b != nil {
				blocked = m.blockOrSkip(b)
				return
			}
			m.log.Warn("copy of a CE request skipped: a signed request under another record's key or in another partition than its id's, "+
				"or naming no id; only a writer that copies records makes one: check the CE topic's ACLs", "partition", p, "offset", r.offset,
				"reason", de.Reason, "detail", de.Detail)
			m.mu.Lock()
			m.skipped[de.Reason]++
			m.mu.Unlock()
			if m.cfg.OnUnauthenticated != nil { // its authenticator is not for where it was written
				m.cfg.OnUnauthenticated(m.cfg.Topic, p, r.offset)
			}
			return
		}
		req.Offset = r.offset
		out = append(out, offsetRequest{req: req, offset: r.offset})
	})
	if blocked != nil {
		next = blocked.Offset
	}
	var w *Witness
	if last != nil {
		x := witnessOf(*last)
		w = &x
	}
	return out, next, w, blocked, err
}

// blocks returns what blocks partition p at the authenticated record r that Decode refused with
// de (Blocked), or nil when r may be a copy: a value signed for another record. The signature
// covers the value, not the key or the partition, so r blocks only when its value names, as a
// string "id" (every format of Request keeps one), the record's key and an id of p; any other
// record is left out, so that a writer without the key cannot block a partition with a copy of
// another record (a replay of a record into its own place is the record: see Blocked).
func (m *Member) blocks(p int, r record, de *DecodeError) *Blocked {
	if de.Reason == ReasonKey || de.Reason == ReasonPartition {
		return nil
	}
	var named struct {
		ID      any `json:"id"`
		Replica any `json:"replica"`
	}
	json.Unmarshal(r.value, &named) // as far as it goes
	if id, ok := named.ID.(string); !ok || id == "" || id != string(r.key) || Partition(id, m.cfg.Partitions) != p {
		return nil
	}
	writer, _ := named.Replica.(string)
	return &Blocked{Partition: p, Offset: r.offset, ID: clip(r.key), Reason: de.Reason, Detail: de.Detail, Writer: clip([]byte(writer))}
}

// Skip is a rule of MemberConfig.Skip: the records of Partition from Offset through Through
// (Offset alone when Through is below it), those of CE id ID only when ID is set.
type Skip struct {
	Partition       int
	Offset, Through int64
	ID              string
}

// names reports whether s names the record that b blocks at.
func (s Skip) names(b *Blocked) bool {
	return s.Partition == b.Partition && s.Offset <= b.Offset && b.Offset <= max(s.Offset, s.Through) && (s.ID == "" || s.ID == b.ID)
}

// blockOrSkip returns b, unless MemberConfig.Skip names its record: then the record is left
// out (counted and logged) and it returns nil.
func (m *Member) blockOrSkip(b *Blocked) *Blocked {
	if !slices.ContainsFunc(m.cfg.Skip, func(s Skip) bool { return s.names(b) }) {
		return b
	}
	m.mu.Lock()
	m.skipped[b.Reason]++
	m.mu.Unlock()
	if m.cfg.OnSkip != nil {
		m.cfg.OnSkip(b.Partition, b.Offset)
	}
	m.log.Warn("CE request this build cannot read skipped, as replication.skip_ce_requests says: the registration or deletion it holds is lost",
		"partition", b.Partition, "offset", b.Offset, "id", b.ID, "writer", b.Writer, "reason", b.Reason, "detail", b.Detail)
	return nil
}

// apply hands batch to Apply in chunks of MaxBatch, checking ctx between them, and returns
// the offset stored with the last chunk applied. after is the offset after the whole batch,
// stored with w (a record before it) by the last chunk.
func (m *Member) apply(ctx context.Context, p int, batch []offsetRequest, next, after int64, w *Witness) (int64, error) {
	if after == next {
		return next, nil
	}
	for {
		n := min(len(batch), m.cfg.MaxBatch)
		chunkNext, cw := after, w
		if n < len(batch) {
			chunkNext, cw = batch[n].offset, nil
		}
		reqs := make([]Request, n)
		for i := range n {
			reqs[i] = batch[i].req
		}
		if err := m.hooks.Apply(ctx, p, reqs, chunkNext, cw); err != nil {
			return next, err
		}
		next = chunkNext
		m.mu.Lock()
		m.applied += int64(n)
		if ps := m.parts[p]; ps != nil {
			ps.next = next
		}
		m.mu.Unlock()
		batch = batch[n:]
		if len(batch) == 0 || ctx.Err() != nil {
			return next, nil
		}
	}
}

// outOfRange handles a fetch refused because next is outside p's log. Below the log start,
// requests were deleted before they were read (the topic's retention is not "for ever"): at
// the first read of a partition acquired from offset 0 with its states, the CEs of those states
// are restored from them (restore); the gap is logged as an ERROR and stored with its count through Lost (unless an
// earlier owner read the partition: then it is stored uncounted), and reading goes on from
// the log start. Past the end, the ledger's offset belongs to another log (the topic was
// deleted and created again): Reset stores offset 0 (and sends the store's CEs of p again), and reading goes
// on from 0, so that no request of the new log is skipped.
func (m *Member) outOfRange(ctx context.Context, cl *kafka.Client, p int, next int64) (int64, error) {
	first, end, err := partitionOffsets(ctx, cl, m.cfg.Topic, p)
	if err != nil {
		return next, nil // the fetch is tried again, and fails again if it must
	}
	switch {
	case next < first:
		m.mu.Lock()
		ps := m.parts[p]
		before := next == 0 && ps != nil && ps.ownedBefore
		// Restored only at the partition's first read from offset 0: the store holds nothing of
		// p then, so a state brings back nothing it has deleted or replaced (past offset 0 it
		// may have applied deletions the state topic does not show yet).
		var states map[string]State
		if next == 0 && ps != nil && !ps.ready {
			states = ps.states
		}
		m.mu.Unlock()
		restored, err := m.restore(ctx, p, next, states)
		if err != nil {
			return next, err
		}
		what := "the CEs they registered or deleted are not in this share"
		if states != nil {
			what = fmt.Sprintf("%d CEs they registered are restored from the states their owners wrote on the CE state topic; "+
				"a CE whose state no owner wrote is not in this share", restored)
		}
		if before {
			// Read from its start by a new owner: an earlier owner read (or found lost) what
			// the topic no longer holds, and a count here would repeat at every move.
			m.log.Error("CE requests were deleted before this replica read them, after an earlier owner of the partition did: "+
				what+"; not counted as lost here",
				"partition", p, "from", next, "to", first, "restored", restored, "fix", "keep the CE topic's retention.ms at -1")
			return m.apply(ctx, p, nil, next, first, nil)
		}
		m.log.Error("CE requests were deleted before they were read: "+what,
			"partition", p, "from", next, "to", first, "restored", restored, "fix", "keep the CE topic's retention.ms at -1")
		if err := m.hooks.Lost(ctx, p, next, first); err != nil {
			return next, err
		}
		m.mu.Lock()
		m.gaps += first - next
		if ps := m.parts[p]; ps != nil {
			ps.next = first
		}
		m.mu.Unlock()
		return first, nil
	case next > end:
		m.log.Error("CE partition ends before what this replica read: the topic was deleted and created again; its requests "+
			"are gone, the partition is read again from offset 0 and this replica's CEs of it are sent again",
			"partition", p, "read_to", next, "end", end)
		return m.reset(ctx, p, next, end, next) // nothing of the new log read: it ends before next
	}
	return next, nil
}

// reset handles partition p being another log than the one the store read to next (the topic
// was deleted and created again; end is the new partition's end; the store may have read the
// new log from offset from on): Reset, then p is read from offset 0.
func (m *Member) reset(ctx context.Context, p int, next, end, from int64) (int64, error) {
	if err := m.hooks.Reset(ctx, p, end, from); err != nil {
		return next, fmt.Errorf("ceshare: partition %d of %q (end %d) is another log than the one this replica read to offset %d "+
			"(the topic was deleted and created again), and its reset failed: %w", p, m.cfg.Topic, end, next, err)
	}
	m.mu.Lock()
	if ps := m.parts[p]; ps != nil {
		ps.next, ps.ready, ps.blocked = 0, false, nil // the blocking record went with the old log
	}
	m.mu.Unlock()
	return 0, nil
}

// errRecords wraps a failure to read the records of a fetch that sameLog made: retried, as the
// read loop retries its own.
var errRecords = errors.New("reading fetched records")

// sameLog fetches p's record at w.Offset and reports whether the partition is another log than
// the one w is a record of (other): its record there hashes otherwise. With no record at
// w.Offset (retention deleted it, the partition ends at or before it, which the read from the
// stored offset then finds, or compaction removed it from a topic an operator compacted) it
// cannot tell, and other is false. end is p's end as the fetch saw it. It asks for one byte: the
// broker still sends the whole first batch, which holds the record.
func (m *Member) sameLog(ctx context.Context, cl *kafka.Client, p int, w Witness) (other bool, end int64, err error) {
	res, err := cl.Fetch(ctx, &kafka.FetchRequest{Topic: m.cfg.Topic, Partition: p, Offset: w.Offset,
		MinBytes: 1, MaxBytes: 1, MaxWait: m.cfg.FetchWait})
	if err == nil && res.Error != nil {
		err = res.Error
	}
	if errors.Is(err, kafka.OffsetOutOfRange) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, err
	}
	var at *Witness
	if _, err := eachRecord(res.Records, w.Offset, func(r record) {
		if r.offset == w.Offset {
			x := witnessOf(r)
			at = &x
		}
	}); err != nil {
		return false, 0, fmt.Errorf("%w: %w", errRecords, err)
	}
	return at != nil && at.Hash != w.Hash, res.HighWatermark, nil
}

// restore hands Apply a registration rebuilt from each of states (Request.Restored; a state
// whose id is not of p, or a late write, State.Late, is left out, WARN), in order of id and in chunks of MaxBatch, each
// stored with p's offset left at next, and returns how many it handed. It runs at a gap found
// at the first read of a partition acquired from offset 0, before the gap is stored, so a
// crash in between restores again (the CEs already restored are found the same and kept).
func (m *Member) restore(ctx context.Context, p int, next int64, states map[string]State) (int, error) {
	ids := slices.Sorted(maps.Keys(states))
	handed := 0
	for len(ids) > 0 && ctx.Err() == nil {
		n := min(len(ids), m.cfg.MaxBatch)
		reqs := make([]Request, 0, n)
		for _, id := range ids[:n] {
			s := states[id]
			if Partition(id, m.cfg.Partitions) != p {
				m.log.Warn("CE state on another partition than its id's: not restored", "partition", p, "id", id, "writer", s.Replica)
				continue
			}
			if s.Late {
				// Compaction may have removed the tombstone before it: a deleted CE would come back.
				m.log.Warn("CE state written by a replica that no longer owned the partition, and no owner's state left: not restored",
					"partition", p, "id", id, "writer", s.Replica)
				continue
			}
			reqs = append(reqs, Request{Kind: KindRegister, ID: id, Replica: s.Replica, Offset: next, State: &s, Restored: true})
		}
		ids = ids[n:]
		if len(reqs) == 0 {
			continue
		}
		if err := m.hooks.Apply(ctx, p, reqs, next, nil); err != nil {
			return handed, err
		}
		handed += len(reqs)
		m.mu.Lock()
		m.restored += int64(len(reqs))
		m.mu.Unlock()
	}
	return handed, ctx.Err()
}

// release forgets p and starts its release (startRelease); the channel closes when the release
// ends (nil when the member did not hold p).
func (m *Member) release(ctx context.Context, p int, why string) chan struct{} {
	m.mu.Lock()
	_, ok := m.parts[p]
	delete(m.parts, p)
	m.mu.Unlock()
	if !ok {
		return nil
	}
	return m.startRelease(ctx, p, why)
}

// startRelease calls Release for p in the background, bounded by ctx only (the member's run): a
// large share takes as long as its deletion takes, and one cut short would leave CEs another
// member owns in the store, where its confirmer and audits would still see them. A partition
// given back meanwhile waits for its release before it is acquired (readPartition). A member
// whose run has ended releases nothing: the store keeps p, and a restart that is not given it
// back releases it (Held). The channel returned closes when the release ends (nil when none
// started). A Release error is logged: the partition is not this member's any more whatever the
// store says.
func (m *Member) startRelease(ctx context.Context, p int, why string) chan struct{} {
	if ctx.Err() != nil {
		return nil
	}
	done := make(chan struct{})
	m.mu.Lock()
	if m.releasing[p] != nil {
		// Not reached: p is released again only once acquired again, after its release.
		m.mu.Unlock()
		m.log.Error("a CE partition's release started while another of it runs: not started", "partition", p)
		return nil
	}
	m.releasing[p] = done
	m.mu.Unlock()
	m.releases.Add(1)
	go func() {
		defer m.releases.Done()
		start := time.Now()
		err := m.hooks.Release(ctx, p)
		m.mu.Lock()
		if m.releasing[p] == done {
			delete(m.releasing, p)
		}
		m.mu.Unlock()
		close(done)
		switch {
		case err != nil && ctx.Err() != nil:
			m.log.Info("a CE partition's release stopped with the member: a restart not given it back releases it again",
				"partition", p, "why", why)
		case err != nil:
			m.log.Error("releasing a CE partition failed: its CEs that are left stay in the store until the replica restarts, "+
				"which releases them again (the partition is held from an earlier run)", "partition", p, "why", why, "err", err)
		default:
			m.log.Info("CE partition released", "partition", p, "why", why, "took", time.Since(start).Round(time.Millisecond))
		}
	}()
	return done
}

// awaitReleases waits for releases to end, ReleaseWait at most: the generation then takes up its
// partitions while the releases still running go on.
func (m *Member) awaitReleases(releases []chan struct{}) {
	deadline := time.After(m.cfg.ReleaseWait)
	for _, done := range releases {
		if done == nil {
			continue
		}
		select {
		case <-done:
		case <-deadline:
			m.mu.Lock()
			running := slices.Sorted(maps.Keys(m.releasing))
			m.mu.Unlock()
			m.log.Warn("CE partitions still being released: they go on in the background", "partitions", running, "waited", m.cfg.ReleaseWait)
			return
		}
	}
}

// forgetAll drops every partition without releasing it: the member stops.
func (m *Member) forgetAll() {
	m.mu.Lock()
	clear(m.parts)
	m.mu.Unlock()
	m.bal.setOwned(nil, 0)
}

func (m *Member) releaseAll(ctx context.Context, why string) {
	var releases []chan struct{}
	for _, p := range m.Owned() {
		releases = append(releases, m.release(ctx, p, why))
	}
	m.awaitReleases(releases)
	m.bal.setOwned(nil, 0)
}
