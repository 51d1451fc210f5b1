package replica

import (
	"encoding/json"
	"errors"
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
// empty assignment to every other member of the topic, reading each member's UserData; it
// records, for assignedWithoutTopic, whether it found no partition of the topic.
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
		{ID: "m-d", Topics: []string{"another"}}, // not of the topic, and before those that are
		{ID: "m-a", Topics: []string{"log"}, UserData: data(updaterData{Led: 3})},
		{ID: "m-b", Topics: []string{"log"}, UserData: mine},
		{ID: "m-c", Topics: []string{"log"}, UserData: []byte("not json")},
	}
	got := b.AssignGroups(members, []kafka.Partition{{Topic: "log", ID: 0}, {Topic: "another", ID: 0}})
	if len(got) != 3 || len(got["m-b"]["log"]) != 1 || len(got["m-a"]["log"]) != 0 || len(got["m-c"]["log"]) != 0 {
		t.Fatalf("assignments %v, want the partition to m-b (led generation 9) and none to m-a, m-c", got)
	}
	if b.assignedWithoutTopic() {
		t.Fatal("an assignment that found the topic's partition says it found none")
	}
	// An assignment without a partition of the topic (deleted) gives nobody the role and says
	// so, once.
	if got := b.AssignGroups(members, []kafka.Partition{{Topic: "another", ID: 0}}); len(got) != 3 || len(got["m-b"]["log"]) != 0 {
		t.Fatalf("assignments without the topic's partition %v, want none for each of m-a, m-b, m-c", got)
	}
	if !b.assignedWithoutTopic() || b.assignedWithoutTopic() {
		t.Fatal("an assignment without the topic's partition is not reported once")
	}
	b.steppedDown()
	members[2].UserData, _ = b.UserData() // m-b's
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

// A term that ends without an error ends the run of failed terms; a failure late in its term
// starts a new run; an early one extends the run. Together with rejoinWait, a replica whose
// terms keep failing fast pauses longer each time, and one that lost its term cleanly pauses
// rejoinPause.
func TestFailedTerms(t *testing.T) {
	failure := errors.New("dead-letter topic refused a record")
	for _, tc := range []struct {
		name string
		prev int
		err  error
		ran  time.Duration
		want int
	}{
		{"a clean end after failures", 4, nil, time.Second, 0},
		{"a clean end after a long term", 4, nil, time.Hour, 0},
		{"the first failure", 0, failure, time.Second, 1},
		{"a failure soon after another", 3, failure, time.Second, 4},
		{"a failure at the span", 3, failure, failedTermSpan, 4},
		{"a failure past the span", 3, failure, failedTermSpan + time.Millisecond, 1},
	} {
		if got := failedTerms(tc.prev, tc.err, tc.ran); got != tc.want {
			t.Errorf("%s: failedTerms(%d, %v, %v) = %d, want %d", tc.name, tc.prev, tc.err, tc.ran, got, tc.want)
		}
	}
}

// A replica dates the updates it applies by their entries' Kafka time, kept within what the
// ends of the log it has seen say of when each entry was appended: after the last look that
// found the log ending at or before the entry, before the first that found it past the entry,
// and never later than now. Replaying a log it has not seen grow, an entry's own time; following
// it, about the time of the write whatever the writer's clock; behind it since long, the time
// of each entry of its backlog.
func TestReplayedAt(t *testing.T) {
	now := time.Now()
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	r := &Replica{}
	check := func(stage string, offset int64, rec, want time.Time, slack time.Duration) {
		t.Helper()
		got := r.replayedAt(postlog.Record{Offset: offset, Time: rec})
		if got.Before(want) || got.After(want.Add(slack)) {
			t.Errorf("%s: the entry at %d of %v dated %v, want %v (+%v)", stage, offset, rec, got, want, slack)
		}
	}
	check("replaying, no end seen", 0, ago(48*time.Hour), ago(48*time.Hour), 0)
	check("replaying, a writer's clock ahead", 0, now.Add(24*time.Hour), now, time.Minute)
	check("replaying, no time", 0, time.Time{}, time.Time{}, 0)

	// The log ended at 100 when the follower first looked three hours ago, and at 100 still
	// when it looked two hours ago; then it grew to 250 (seen one hour ago) and 300 (seen now).
	r.read = 40
	for _, e := range []struct {
		end     int64
		asked   time.Time
		wantLag int64
	}{{100, ago(3 * time.Hour), 60}, {100, ago(2 * time.Hour), 60}, {250, ago(time.Hour), 210}, {300, ago(time.Second), 260}} {
		if lag := r.sawEnd(e.end, e.asked, e.asked.Add(time.Millisecond)); lag != e.wantLag {
			t.Fatalf("sawEnd(%d): lag %d, want %d", e.end, lag, e.wantLag)
		}
	}
	check("an entry there at the first look", 50, ago(48*time.Hour), ago(48*time.Hour), 0)
	check("... whose writer's clock is ahead", 50, ago(time.Minute), ago(3*time.Hour), time.Millisecond)
	check("an entry appended between the second look and the third", 120, ago(90*time.Minute), ago(90*time.Minute), 0)
	check("... whose writer's clock is behind", 120, ago(48*time.Hour), ago(2*time.Hour), 0)
	check("... whose writer's clock is ahead", 120, ago(time.Minute), ago(time.Hour), time.Millisecond)
	check("an entry appended in the last hour, a writer's clock behind", 280, ago(48*time.Hour), ago(time.Hour), 0)
	check("an entry past every end seen, a writer's clock behind", 300, ago(48*time.Hour), ago(time.Second), 0)
	check("... a writer's clock ahead", 300, now.Add(24*time.Hour), now, time.Minute)

	// Read past 250: the ends below it but the last are forgotten; the rest still date.
	r.read = 260
	r.sawEnd(300, now, now)
	if len(r.logEnds) != 2 || r.logEnds[0].end != 250 {
		t.Fatalf("ends kept after reading to 260: %+v, want 250 and 300", r.logEnds)
	}
	check("after reading on", 280, ago(48*time.Hour), ago(time.Hour), 0)

	// A log that ends before an end seen was cut (an unclean election, a recreated topic) or its
	// new leader's end is catching up: the ends past it may not be of the records it holds now.
	// An entry of a new history past the cut is dated by what is seen after it, not by an end
	// of the records cut.
	r = &Replica{read: 100}
	r.sawEnd(600, ago(2*time.Hour), ago(2*time.Hour))
	r.sawEnd(550, ago(time.Minute), ago(time.Minute))
	if len(r.logEnds) != 0 {
		t.Fatalf("ends after the log was cut to 550: %+v, want those past it forgotten and 550 not recorded", r.logEnds)
	}
	r.sawEnd(570, ago(time.Second), ago(time.Second))
	check("an entry written after the log was cut", 560, ago(2*time.Second), ago(2*time.Second), 0)
	check("an entry written after the cut, a writer's clock behind", 560, ago(48*time.Hour), ago(48*time.Hour), 0)
	check("an entry written after the cut, a writer's clock ahead", 560, now.Add(time.Hour), ago(time.Second), 0)

	// A follower far behind a growing log keeps the newest maxLogEnds ends.
	r = &Replica{}
	for i := range maxLogEnds + 5 {
		r.sawEnd(int64(10+i), now, now)
	}
	if n := len(r.logEnds); n != maxLogEnds || r.logEnds[0].end != 15 {
		t.Fatalf("%d ends kept, the oldest %d; want %d from 15", n, r.logEnds[0].end, maxLogEnds)
	}
}
