package replica

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/postlog"
)

// The updater role stays with the member that held it last, unless it stepped down; without
// such a member it goes to the first member by id; whichever member computes it.
func TestPickUpdater(t *testing.T) {
	for _, tc := range []struct {
		name string
		data map[string]updaterData
		want string
	}{
		{"none", map[string]updaterData{}, ""},
		{"a new group: the first by id", map[string]updaterData{"m-b": {}, "m-a": {}, "m-c": {}}, "m-a"},
		{"the holder keeps it when a member joins", map[string]updaterData{"m-b": {Led: 4}, "m-a": {}}, "m-b"},
		{"the latest holder of two", map[string]updaterData{"m-a": {Led: 3}, "m-b": {Led: 7}, "m-c": {Led: 5}}, "m-b"},
		{"a holder that stepped down gives it up", map[string]updaterData{"m-a": {}, "m-b": {Led: 7, SteppedDown: true}}, "m-a"},
		{"... to an earlier holder first", map[string]updaterData{"m-a": {}, "m-b": {Led: 7, SteppedDown: true}, "m-c": {Led: 3}}, "m-c"},
		{"every member stepped down: the latest holder", map[string]updaterData{"m-a": {Led: 2, SteppedDown: true}, "m-b": {Led: 7, SteppedDown: true}}, "m-b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ids []string
			for id := range tc.data {
				ids = append(ids, id)
			}
			if got := pickUpdater(ids, tc.data); got != tc.want {
				t.Errorf("pickUpdater = %q, want %q", got, tc.want)
			}
		})
	}
}

// AssignGroups gives the posterior topic's partition to the member pickUpdater names and an
// empty assignment to every other member of the topic, reading each member's UserData.
func TestUpdaterBalancerAssigns(t *testing.T) {
	data := func(d updaterData) []byte {
		b, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	b := &updaterBalancer{topic: "log"}
	b.led(9, true)
	mine, err := b.UserData()
	if err != nil {
		t.Fatal(err)
	}
	members := []kafka.GroupMember{
		{ID: "m-a", Topics: []string{"log"}, UserData: data(updaterData{Led: 3})},
		{ID: "m-b", Topics: []string{"log"}, UserData: mine},
		{ID: "m-c", Topics: []string{"log"}, UserData: []byte("not json")},
		{ID: "m-d", Topics: []string{"another"}},
	}
	got := b.AssignGroups(members, []kafka.Partition{{Topic: "log", ID: 0}, {Topic: "another", ID: 0}})
	if len(got) != 3 || len(got["m-b"]["log"]) != 1 || len(got["m-a"]["log"]) != 0 || len(got["m-c"]["log"]) != 0 {
		t.Fatalf("assignments %v, want the partition to m-b (led generation 9) and none to m-a, m-c", got)
	}
	b.steppedDown()
	members[1].UserData, _ = b.UserData()
	if got := b.AssignGroups(members, []kafka.Partition{{Topic: "log", ID: 0}}); len(got["m-a"]["log"]) != 1 {
		t.Fatalf("after m-b stepped down: %v, want the partition to m-a (led generation 3)", got)
	}
	// A generation that does not give m-b the role clears what it says: neither holder nor
	// stepped down.
	b.led(10, false)
	if got, _ := b.UserData(); string(got) != string(data(updaterData{})) {
		t.Fatalf("UserData after a generation without the role: %s, want %s", got, data(updaterData{}))
	}
}

// rejoinWait doubles the pause with each consecutive failed term, from rejoinPause, up to
// maxRejoinPause.
func TestRejoinWait(t *testing.T) {
	for _, tc := range []struct {
		failed int
		want   time.Duration
	}{{0, time.Second}, {1, time.Second}, {2, 2 * time.Second}, {3, 4 * time.Second}, {5, 16 * time.Second}, {6, maxRejoinPause}, {100, maxRejoinPause}} {
		if got := rejoinWait(tc.failed); got != tc.want {
			t.Errorf("rejoinWait(%d) = %v, want %v", tc.failed, got, tc.want)
		}
	}
}

// A replica dates the updates it applies by their entries' Kafka time, never later than now and
// never before the last time it was at the log's end: replaying the log from its start (never at
// the end yet), an entry's own time; following the log as it grows, about the time of the write,
// whatever the writer's clock; behind the log since long, the time of each entry of its backlog.
func TestReplayedAt(t *testing.T) {
	now := time.Now()
	r := &Replica{read: 10}
	check := func(stage string, rec, want time.Time, slack time.Duration) {
		t.Helper()
		got := r.replayedAt(postlog.Record{Time: rec})
		if got.Before(want) || got.After(want.Add(slack)) {
			t.Errorf("%s: an entry of %v dated %v, want %v (+%v)", stage, rec, got, want, slack)
		}
	}
	check("replaying", now.Add(-48*time.Hour), now.Add(-48*time.Hour), 0)
	check("replaying, a writer's clock ahead", now.Add(24*time.Hour), now, time.Minute)
	check("replaying, no time", time.Time{}, time.Time{}, 0)

	if lag := r.sawEnd(10, now.Add(-time.Second)); lag != 0 || !r.caughtUp {
		t.Fatalf("sawEnd at the end: lag %d, caught up %v", lag, r.caughtUp)
	}
	check("following, a writer's clock behind", now.Add(-48*time.Hour), now.Add(-time.Second), 0)
	check("following, a writer's clock ahead", now.Add(24*time.Hour), now, time.Minute)

	r.atEnd = now.Add(-2 * time.Hour) // as a follower that last reached the end two hours ago
	if lag := r.sawEnd(25, now); lag != 15 || !r.atEnd.Equal(now.Add(-2*time.Hour)) {
		t.Fatalf("sawEnd behind: lag %d, at the end %v; want 15 and the end two hours ago kept", lag, r.atEnd)
	}
	check("behind, an entry of its backlog", now.Add(-time.Hour), now.Add(-time.Hour), 0)
	check("behind, an entry before it fell behind", now.Add(-48*time.Hour), now.Add(-2*time.Hour), 0)

	// A log that ends before what the follower read (recreated, or a new leader's end catching
	// up) was not appended after it was seen: it leaves the last time at the end as it was.
	r.read = 50
	if lag := r.sawEnd(20, now); lag != 0 || !r.atEnd.Equal(now.Add(-2*time.Hour)) {
		t.Fatalf("sawEnd on a short log: lag %d, at the end %v; want 0 and the end two hours ago kept", lag, r.atEnd)
	}
}
