package ceshare

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/stream"
)

// ErrNoOwner is matched (errors.Is) when no member owns a CE's partition: the group is
// rebalancing, or has no member. The caller answers 503 and lets the client retry.
var ErrNoOwner = errors.New("ceshare: no replica owns the partition")

// Owner is the member that owns a partition, as the group describes it.
type Owner struct {
	Replica  string // replication.replica_id of the member
	URL      string // its replication.advertise_url
	MemberID string // its member id in the group
}

// Directory answers which replica owns a CE: the owner of the CE's partition in the CE group,
// found with DescribeGroups (each member's assignment, and the replica id and URL its
// UserData carries). Answers are cached: an entry is used for at most MaxAge (1s), and a
// partition missing from the cache is looked up again at once, unless the last look-up was
// under MinRefresh (100ms) ago. It is safe for concurrent use.
type Directory struct {
	group, topic string
	partitions   int
	cl           *kafka.Client
	tr           *kafka.Transport
	stop         context.CancelFunc
	log          *slog.Logger
	keys         *clusterkey.Keyring

	// MaxAge and MinRefresh tune the cache (set them before the first Owner call).
	MaxAge, MinRefresh time.Duration

	rmu     sync.Mutex      // guards refused (taken under mu, by lookUp)
	refused map[string]bool // members whose data did not authenticate, logged once each

	mu       sync.Mutex
	owners   map[int]Owner // by partition, as of at
	state    string        // the group's state, as of at
	at       time.Time
	refresh  error         // the last look-up's error
	inflight chan struct{} // closed when the look-up in flight ends; nil when none is
}

// NewDirectory returns a Directory of group's owners of topic's partitions (partitions is the
// topic's partition count). A member whose data does not authenticate under keys (the
// cluster's) owns nothing and is no member to it. Its connections close on Close or when ctx
// ends.
func NewDirectory(ctx context.Context, conn stream.ConnConfig, group, topic string, partitions int, keys *clusterkey.Keyring, log *slog.Logger) (*Directory, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if group == "" || topic == "" || partitions < 1 {
		return nil, fmt.Errorf("ceshare: NewDirectory: group %q, topic %q, partitions %d: want a group, a topic and at least 1 partition",
			group, topic, partitions)
	}
	ctx, stop := context.WithCancel(ctx)
	tr, err := conn.Transport(ctx)
	if err != nil {
		stop()
		return nil, err
	}
	return &Directory{group: group, topic: topic, partitions: partitions, tr: tr, stop: stop, keys: keys, refused: map[string]bool{},
		cl: &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: tr}, log: log.With("group", group),
		MaxAge: time.Second, MinRefresh: 100 * time.Millisecond}, nil
}

// Owner returns the replica that owns CE id's partition. It fails with an error matching
// ErrNoOwner when none does, or with the broker's error.
func (d *Directory) Owner(ctx context.Context, id string) (Owner, error) {
	p := Partition(id, d.partitions)
	d.mu.Lock()
	age := time.Since(d.at)
	_, ok := d.owners[p]
	d.mu.Unlock()
	if age >= d.MaxAge || (!ok && age >= d.MinRefresh) {
		d.lookUp(ctx)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	o, ok := d.owners[p]
	switch {
	case ok:
		return o, nil
	case d.refresh != nil:
		return Owner{}, d.refresh
	}
	return Owner{}, fmt.Errorf("%w: partition %d of %q, group %q is %s", ErrNoOwner, p, d.topic, d.group, d.state)
}

// Owners returns the owner of every partition, looked up again when the cache is older than
// MinRefresh, so that a list or an audit that asks every owner sees the group as it is. It fails
// with an error matching ErrNoOwner naming the partitions no member owns (the group is
// rebalancing), or with the broker's error.
func (d *Directory) Owners(ctx context.Context) (map[int]Owner, error) {
	d.mu.Lock()
	stale := time.Since(d.at) >= d.MinRefresh || len(d.owners) < d.partitions
	d.mu.Unlock()
	if stale {
		d.lookUp(ctx)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.refresh != nil {
		return nil, d.refresh
	}
	var missing []int
	for p := range d.partitions {
		if _, ok := d.owners[p]; !ok {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: partitions %v of %q, group %q is %s", ErrNoOwner, missing, d.topic, d.group, d.state)
	}
	return maps.Clone(d.owners), nil
}

// Members returns every member of the group that carries replica data, as the broker describes
// the group now (not cached): what another member with the same replica id reveals.
func (d *Directory) Members(ctx context.Context) ([]Owner, error) {
	g, err := d.describe(ctx)
	if err != nil {
		return nil, err
	}
	return d.membersOf(g.Members), nil
}

// membersOf returns the members whose data authenticates. A member without data (every member,
// between generations) is not judged and logs nothing; one whose data does not authenticate is
// left out, with a WARN line.
func (d *Directory) membersOf(members []kafka.DescribeGroupsResponseMember) []Owner {
	var out []Owner
	for _, m := range members {
		if len(m.MemberMetadata.UserData) == 0 {
			continue
		}
		if md, ok := d.memberData(m); ok {
			out = append(out, Owner{Replica: md.Replica, URL: md.URL, MemberID: m.MemberID})
		}
	}
	return out
}

// describe asks the broker for the group as it is now.
func (d *Directory) describe(ctx context.Context) (kafka.DescribeGroupsResponseGroup, error) {
	res, err := d.cl.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{d.group}})
	if err == nil && len(res.Groups) != 1 {
		err = fmt.Errorf("the broker described %d groups, want 1", len(res.Groups))
	}
	if err == nil {
		err = res.Groups[0].Error
	}
	if err != nil {
		return kafka.DescribeGroupsResponseGroup{}, fmt.Errorf("ceshare: describing group %q: %w", d.group, err)
	}
	return res.Groups[0], nil
}

// lookUp describes the group and rebuilds the cache, one look-up at a time: a caller that
// finds one in flight waits for it instead of asking the broker again (so that a slow broker
// costs one question, not one per caller in turn), and asks itself when the one it waited for
// was given up. A caller whose context ended (it gave up, or asked with a context already over)
// leaves the cache as it was: its error is not the group's, and would fail every caller until
// the next refresh.
func (d *Directory) lookUp(ctx context.Context) {
	d.mu.Lock()
	for d.inflight != nil {
		ch, at := d.inflight, d.at
		d.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return
		}
		d.mu.Lock()
		if d.at != at { // the look-up waited for ended the group's way
			d.mu.Unlock()
			return
		}
	}
	ch := make(chan struct{})
	d.inflight = ch
	d.mu.Unlock()
	g, err := d.describe(ctx)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.inflight = nil
	close(ch)
	if err != nil && ctx.Err() != nil {
		return
	}
	d.at = time.Now()
	if err != nil {
		d.owners, d.refresh = nil, err
		return
	}
	d.forgetGone(g.Members)
	d.owners, d.state, d.refresh = d.ownersOf(g.Members), g.GroupState, nil
}

// ownersOf maps each partition of the topic to the member the group assigned it to, among the
// members whose data authenticates. A member assigned none of the topic's partitions owns
// nothing and is not judged: between generations every member's data and assignment are empty.
func (d *Directory) ownersOf(members []kafka.DescribeGroupsResponseMember) map[int]Owner {
	owners := make(map[int]Owner, d.partitions)
	for _, m := range members {
		var parts []int
		for _, t := range m.MemberAssignments.Topics {
			if t.Topic == d.topic {
				parts = append(parts, t.Partitions...)
			}
		}
		if len(parts) == 0 {
			continue
		}
		md, ok := d.memberData(m)
		if !ok {
			continue
		}
		for _, p := range parts {
			owners[p] = Owner{Replica: md.Replica, URL: md.URL, MemberID: m.MemberID}
		}
	}
	return owners
}

// forgetGone drops the refused members that are no longer in the group.
func (d *Directory) forgetGone(members []kafka.DescribeGroupsResponseMember) {
	d.rmu.Lock()
	defer d.rmu.Unlock()
	keepOnly(d.refused, func(id string) bool {
		return slices.ContainsFunc(members, func(m kafka.DescribeGroupsResponseMember) bool { return m.MemberID == id })
	})
}

// memberData is member m's data, ok false (logged at WARN once per member) when it does not
// authenticate.
func (d *Directory) memberData(m kafka.DescribeGroupsResponseMember) (memberData, bool) {
	md, err := decodeMemberData(d.keys, m.MemberMetadata.UserData)
	if err == nil {
		return md, true
	}
	d.rmu.Lock()
	first := !d.refused[m.MemberID]
	d.refused[m.MemberID] = true
	d.rmu.Unlock()
	if first {
		d.log.Warn("a member of the CE group whose data does not authenticate under the cluster key is ignored: it owns no CE here",
			"member", m.MemberID, "client", m.ClientID, "host", m.ClientHost, "err", err)
	}
	return memberData{}, false
}

// Close closes the directory's connections.
func (d *Directory) Close() error {
	d.stop()
	d.tr.CloseIdleConnections()
	return nil
}
