package ceshare

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
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
	// generation starts; one it gives back that another replica claimed since is released and
	// rebuilt from offset 0 with that replica's states. Default: none.
	Held []int
	// Now, when set, is the clock the member reads to find a pause of its process (Settled):
	// a test moves it on past the session, as a pause does, while the process goes on.
	// Default: time.Now.
	Now func() time.Time

	// dial, when set, replaces the member's dialing (tests cut a member off the broker).
	dial func(ctx context.Context, network, address string) (net.Conn, error)
	// decode is Decode, or what a test sets to play a build that reads another format.
	decode func(key, value []byte) (Request, error)
	// beforeFetch, when set, is called before each fetch of a partition's requests, with the
	// offset it reads from (a test holds a partition's read there).
	beforeFetch func(p int, next int64)
	// afterClaim, when set, is called once a claim of partition p is written, before the member
	// reads on (a test writes a state there).
	afterClaim func(p int)
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
	// acquired: the acquisition (the claim and states on the CE state topic) is done; a
	// generation that ended before it leaves it false, and the next one acquires p afresh.
	acquired bool
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
	joinErr     error                 // why the last join of the group failed; nil once one worked
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
	// settled is closed once the first generation has released the Held partitions it gives
	// to others, and replaced by an open one when the process was paused past its session
	// (Settled); guarded by mu, with stamp, the last time the member looked (checkPause).
	settled chan struct{}
	stamp   time.Time
	// pausedAt and pausedGen: when a pause reopened Settled within generation pausedGen (not 0),
	// so that a stamp a session timeout later settles it if that generation is still this
	// member's (survived); zero when no pause is followed.
	pausedAt  time.Time
	pausedGen int32
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
		releasing: map[int]chan struct{}{}, settled: make(chan struct{}),
		bal: &stickyBalancer{topic: cfg.Topic, replica: cfg.ReplicaID, url: cfg.AdvertiseURL, owned: slices.Clone(cfg.Held), keys: cfg.Keys}}
	if len(cfg.Held) == 0 {
		m.settle()
	}
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

// Settled returns a channel closed once the store holds no CE of a partition held from an
// earlier run (MemberConfig.Held) that another member owns: when the first generation's
// releases of those it gives to others have ended, or ReleaseWait has passed (then the
// releases still running go on, as every release does); at once when nothing is held. Until
// then the store holds a stopped replica's copies of CEs that another replica may have owned,
// judged and published meanwhile: whoever re-certifies, confirms, reissues or audits the
// store's CEs waits for it, or it would publish stale changes of CEs it gives up. It is closed
// before the generation takes up its partitions, so that nothing Hooks.Apply waits for waits
// for it.
//
// A process paused past its session (SIGSTOP, a stall of its VM) resumes with the partitions of
// a generation the group may have ended meanwhile, and another member may have owned, judged
// and published their CEs. The member stamps the time every pauseTick; when it finds a gap
// longer than the session timeout less one heartbeat interval (the group may have evicted it),
// here or at its next stamp, Settled returns an open channel again, closed once the next
// generation released the partitions it does not give back, or once the member has seen its
// generation go on for a session timeout after the pause (it was not evicted).
func (m *Member) Settled() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.checkPause(m.now())
	return m.settled
}

// now is the time checkPause stamps: MemberConfig.Now, else time.Now.
func (m *Member) now() time.Time {
	if m.cfg.Now != nil {
		return m.cfg.Now()
	}
	return time.Now()
}

// settle closes the open Settled channel.
func (m *Member) settle() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.settleLocked()
}

func (m *Member) settleLocked() {
	select {
	case <-m.settled:
	default:
		close(m.settled)
	}
}

// pauseTick is how often the member stamps the time to find a pause of its process.
const pauseTick = 100 * time.Millisecond

// checkPause stamps now, and reopens Settled when the last stamp is so old that the group may
// have ended this member's generation meanwhile (Settled). It is called with m.mu held.
func (m *Member) checkPause(now time.Time) {
	last := m.stamp
	m.stamp = now
	gap := now.Sub(last)
	if last.IsZero() || gap <= m.cfg.SessionTimeout-m.cfg.HeartbeatInterval {
		m.survived(now)
		return
	}
	select {
	case <-m.settled:
	default:
		return // not settled yet: the generation to come settles it
	}
	m.settled = make(chan struct{})
	gen := m.generation
	m.log.Warn("this process was paused past the CE group's session: the group may have given its partitions to other members; "+
		"its store's CEs are judged again once the next generation released what it lost",
		"paused", gap.Round(time.Millisecond), "session_timeout", m.cfg.SessionTimeout, "generation", gen, "partitions", slices.Sorted(maps.Keys(m.parts)))
	m.pausedAt, m.pausedGen = time.Time{}, 0
	if gen != 0 {
		m.pausedAt, m.pausedGen = now, gen
	}
}

// survived settles, at a stamp a session timeout after a pause that reopened Settled, when the
// generation of the pause is still this member's: the group did not evict it. A generation
// ended meanwhile leaves Settled to the next one (serve). It is called with m.mu held.
func (m *Member) survived(now time.Time) {
	if m.pausedAt.IsZero() || now.Sub(m.pausedAt) < m.cfg.SessionTimeout {
		return
	}
	if m.generation == m.pausedGen {
		m.log.Info("the CE generation went on after the pause: re-certification goes on", "generation", m.pausedGen)
		m.settleLocked()
	}
	m.pausedAt, m.pausedGen = time.Time{}, 0
}

// watchPauses stamps the time every pauseTick until ctx ends (checkPause).
func (m *Member) watchPauses(ctx context.Context) {
	tick := time.NewTicker(pauseTick)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		m.mu.Lock()
		m.checkPause(m.now())
		m.mu.Unlock()
	}
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

// JoinError is why the member's last attempt to join the group failed, or nil once one worked.
func (m *Member) JoinError() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.joinErr
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
	go m.watchPauses(ctx)
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
			joinErr := stream.GroupJoinError(err, "replication.session_timeout", m.cfg.SessionTimeout)
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
				m.log.Warn("joining the CE group failed; retrying", "err", joinErr, "failures", failures+1)
			}
			if ctx.Err() == nil {
				m.mu.Lock()
				m.joinErr = joinErr
				m.mu.Unlock()
			}
			failures++
			continue
		}
		m.mu.Lock()
		m.joinErr = nil
		m.mu.Unlock()
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
		m.settle() // the store holds no partition of this member's any more
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
	m.settle() // before any partition is taken up: Hooks.Apply may wait for what Settled holds back
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
