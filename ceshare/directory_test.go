package ceshare

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

// The directory maps each partition to the member assigned it whose data authenticates. A
// member assigned nothing (every member, between generations) is not judged and logs nothing;
// one assigned partitions whose data does not authenticate owns none of them, with a WARN line.
// Members judges only the members that carry data.
func TestDirectoryJudgesOnlyMembersThatOwnPartitions(t *testing.T) {
	keys := testKeys()
	var logs bytes.Buffer
	d, err := NewDirectory(context.Background(), stream.ConnConfig{Brokers: []string{"127.0.0.1:1"}}, "g", "t", 4, keys,
		slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	signed, err := encodeMemberData(keys, memberData{Replica: "r1", URL: "http://127.0.0.1:8080"})
	if err != nil {
		t.Fatal(err)
	}
	assigned := func(ps ...int) kafka.DescribeGroupsResponseAssignments {
		return kafka.DescribeGroupsResponseAssignments{Topics: []kafka.GroupMemberTopic{{Topic: "t", Partitions: ps}, {Topic: "other", Partitions: []int{3}}}}
	}
	members := []kafka.DescribeGroupsResponseMember{
		{MemberID: "m-r1", MemberMetadata: kafka.DescribeGroupsResponseMemberMetadata{UserData: signed}, MemberAssignments: assigned(0, 1)},
		{MemberID: "m-rejoining"}, // between generations: no data, no assignment
		{MemberID: "m-other-topic", MemberAssignments: kafka.DescribeGroupsResponseAssignments{Topics: []kafka.GroupMemberTopic{{Topic: "other", Partitions: []int{2}}}}},
		{MemberID: "m-forged", MemberMetadata: kafka.DescribeGroupsResponseMemberMetadata{UserData: []byte(`{"data":"e30=","auth":"x"}`)}, MemberAssignments: assigned(2)},
	}
	owners := d.ownersOf(members)
	if len(owners) != 2 || owners[0].Replica != "r1" || owners[1].MemberID != "m-r1" {
		t.Errorf("owners %+v, want partitions 0 and 1 to r1 alone", owners)
	}
	for _, id := range []string{"m-rejoining", "m-other-topic", "m-r1"} {
		if strings.Contains(logs.String(), id) {
			t.Errorf("the log names %s, which owns nothing here or authenticates:\n%s", id, logs.String())
		}
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "member=m-forged") {
		t.Errorf("no WARN line names m-forged, assigned a partition with data that does not authenticate:\n%s", logs.String())
	}

	// Members (the replica-id check) judges the same way: the members carrying data, those that
	// authenticate returned; a member between generations is not named.
	logs.Reset()
	d.refused = map[string]bool{}
	if got := d.membersOf(members); len(got) != 1 || got[0].MemberID != "m-r1" {
		t.Errorf("members %+v, want m-r1 alone", got)
	}
	for _, id := range []string{"m-rejoining", "m-other-topic", "m-r1"} {
		if strings.Contains(logs.String(), id) {
			t.Errorf("Members logs %s, which carries no data or authenticates:\n%s", id, logs.String())
		}
	}
	if !strings.Contains(logs.String(), "member=m-forged") {
		t.Errorf("Members: no WARN line names m-forged:\n%s", logs.String())
	}
}

// describeCounter counts the DescribeGroups requests a kfake cluster answers, and answers them
// with a group error while failing is set, as a coordinator that moves does.
type describeCounter struct {
	kc      *kfake.Cluster
	mu      sync.Mutex
	n       int
	failing bool
}

func (c *describeCounter) control(req kmsg.Request) (kmsg.Response, error, bool) {
	c.kc.KeepControl()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n++
	if !c.failing {
		return nil, nil, false
	}
	r := req.(*kmsg.DescribeGroupsRequest)
	res := r.ResponseKind().(*kmsg.DescribeGroupsResponse)
	res.Version = r.Version
	for _, g := range r.Groups {
		rg := kmsg.NewDescribeGroupsResponseGroup()
		rg.Group, rg.ErrorCode = g, int16(kafka.GroupCoordinatorNotAvailable)
		res.Groups = append(res.Groups, rg)
	}
	return res, nil, true
}

func (c *describeCounter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

func (c *describeCounter) fail(f bool) {
	c.mu.Lock()
	c.failing = f
	c.mu.Unlock()
}

// The Directory's cache: Owner looks a partition the cache lacks up again once MinRefresh has
// passed, and otherwise answers from the cache until MaxAge; Owners looks the group up again
// when the cache lacks a partition, or is MinRefresh old, and hands out a copy of it. A look-up
// that fails empties the cache: Owner and Owners fail with the broker's error (not ErrNoOwner,
// nor an owner from before).
func TestDirectoryCacheRules(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	c := &describeCounter{kc: kc}
	kc.ControlKey(int16(kmsg.DescribeGroups), c.control)
	conn := stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second}
	ctx := context.Background()
	// ownerDir asks with Owner, ownersDir with Owners; both looked the group up once before it
	// had members, and keep that answer for an hour.
	ownerDir, ownersDir := testDirectory(t, conn), testDirectory(t, conn)
	for _, d := range []*Directory{ownerDir, ownersDir} {
		d.MaxAge, d.MinRefresh = time.Hour, time.Hour
	}
	if _, err := ownerDir.Owner(ctx, "a"); !errors.Is(err, ErrNoOwner) {
		t.Fatalf("Owner before any member: %v, want ErrNoOwner", err)
	}
	if _, err := ownersDir.Owners(ctx); !errors.Is(err, ErrNoOwner) {
		t.Fatalf("Owners before any member: %v, want ErrNoOwner", err)
	}
	r := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition", func() bool { return ownership(r) != nil })

	// Within MinRefresh, Owner answers from the cache, even that no member owns a partition.
	n := c.count()
	if _, err := ownerDir.Owner(ctx, "a"); !errors.Is(err, ErrNoOwner) || c.count() != n {
		t.Errorf("Owner within MinRefresh of a look-up: %v after %d look-ups; want the cached ErrNoOwner, no look-up", err, c.count()-n)
	}
	// Past MinRefresh, a partition missing from the cache is looked up at once (MaxAge is an hour).
	ownerDir.MinRefresh = 0
	if o, err := ownerDir.Owner(ctx, "a"); err != nil || o.Replica != "r1" {
		t.Errorf("Owner of a partition missing from the cache, past MinRefresh: %+v, %v; want r1", o, err)
	}
	// A partition the cache holds is answered from it until MaxAge.
	n = c.count()
	if o, err := ownerDir.Owner(ctx, "b"); err != nil || o.Replica != "r1" || c.count() != n {
		t.Errorf("Owner from a full cache: %+v, %v after %d look-ups; want r1 and no look-up", o, err, c.count()-n)
	}

	// Owners of a cache that lacks partitions looks the group up whatever MinRefresh says.
	all, err := ownersDir.Owners(ctx)
	if err != nil || len(all) != testPartitions {
		t.Fatalf("Owners of an incomplete cache: %v, %v; want all %d partitions", all, err, testPartitions)
	}
	// A complete cache within MinRefresh is answered from, as a copy: what a caller does to the
	// map it got changes nothing.
	clear(all)
	n = c.count()
	if again, err := ownersDir.Owners(ctx); err != nil || len(again) != testPartitions || c.count() != n {
		t.Errorf("Owners within MinRefresh, after a caller cleared its map: %d partitions, %v, %d look-ups; want %d, no look-up",
			len(again), err, c.count()-n, testPartitions)
	}
	// Past MinRefresh it is looked up again.
	ownersDir.MinRefresh = 0
	if _, err := ownersDir.Owners(ctx); err != nil || c.count() != n+1 {
		t.Errorf("Owners past MinRefresh: %v after %d look-ups, want 1", err, c.count()-n)
	}

	// The coordinator fails the look-up: both fail with its error, not with an owner from the
	// cache nor ErrNoOwner.
	c.fail(true)
	ownerDir.MaxAge = 0
	if o, err := ownerDir.Owner(ctx, "a"); !errors.Is(err, kafka.GroupCoordinatorNotAvailable) || errors.Is(err, ErrNoOwner) {
		t.Errorf("Owner when the look-up fails: %+v, %v; want the coordinator's error", o, err)
	}
	if o, err := ownersDir.Owners(ctx); !errors.Is(err, kafka.GroupCoordinatorNotAvailable) || errors.Is(err, ErrNoOwner) {
		t.Errorf("Owners when the look-up fails: %v, %v; want the coordinator's error", o, err)
	}
	c.fail(false)
}

// A member whose data does not authenticate is logged once, however many look-ups find it,
// and NewDirectory refuses a directory of no group, no topic or no partition.
func TestDirectoryLogsAMemberOnceAndRefusesNoPartitions(t *testing.T) {
	keys := testKeys()
	var logs bytes.Buffer
	conn := stream.ConnConfig{Brokers: []string{"127.0.0.1:1"}}
	d, err := NewDirectory(context.Background(), conn, "g", "t", 4, keys, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	forged := []kafka.DescribeGroupsResponseMember{{MemberID: "m-forged",
		MemberMetadata:    kafka.DescribeGroupsResponseMemberMetadata{UserData: []byte(`{"data":"e30=","auth":"x"}`)},
		MemberAssignments: kafka.DescribeGroupsResponseAssignments{Topics: []kafka.GroupMemberTopic{{Topic: "t", Partitions: []int{0}}}}}}
	for range 3 {
		d.ownersOf(forged)
		d.membersOf(forged)
	}
	if n := strings.Count(logs.String(), "member=m-forged"); n != 1 {
		t.Errorf("%d lines name m-forged after 3 look-ups, want 1:\n%s", n, logs.String())
	}
	for _, tc := range []struct {
		group, topic string
		partitions   int
	}{{"", "t", 1}, {"g", "", 1}, {"g", "t", 0}} {
		if d, err := NewDirectory(context.Background(), conn, tc.group, tc.topic, tc.partitions, keys, nil); err == nil {
			d.Close()
			t.Errorf("NewDirectory(%q, %q, %d) made a directory", tc.group, tc.topic, tc.partitions)
		}
	}
}
