package ceshare

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/clusterkey"
)

func parts(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// checkAssignment fails unless every partition has exactly one member and shares differ by
// one at most.
func checkAssignment(t *testing.T, got map[string][]int, members []string, n int) {
	t.Helper()
	owner := map[int]string{}
	lo, hi := n, 0
	for _, m := range members {
		for _, p := range got[m] {
			if o, dup := owner[p]; dup {
				t.Fatalf("partition %d assigned to %s and %s: %v", p, o, m, got)
			}
			owner[p] = m
		}
		lo, hi = min(lo, len(got[m])), max(hi, len(got[m]))
	}
	if len(owner) != n {
		t.Fatalf("%d of %d partitions assigned: %v", len(owner), n, got)
	}
	if hi-lo > 1 {
		t.Fatalf("shares from %d to %d partitions, want within one: %v", lo, hi, got)
	}
}

func TestAssignStickyBalancesAndKeeps(t *testing.T) {
	// First generation: nothing owned.
	a := assignSticky([]string{"m1", "m2", "m3"}, parts(12), nil)
	checkAssignment(t, a, []string{"m1", "m2", "m3"}, 12)

	prev := func(gen int32, members ...string) map[string]memberData {
		out := map[string]memberData{}
		for _, m := range members {
			out[m] = memberData{Owned: a[m], Generation: gen}
		}
		return out
	}
	// The same members again: nothing moves.
	if b := assignSticky([]string{"m1", "m2", "m3"}, parts(12), prev(1, "m1", "m2", "m3")); !equalAssign(a, b) {
		t.Errorf("a rebalance with the same members moved partitions: %v, then %v", a, b)
	}
	// m2 leaves: m1 and m3 keep theirs and split m2's.
	b := assignSticky([]string{"m1", "m3"}, parts(12), prev(1, "m1", "m3"))
	checkAssignment(t, b, []string{"m1", "m3"}, 12)
	for _, m := range []string{"m1", "m3"} {
		for _, p := range a[m] {
			if !slices.Contains(b[m], p) {
				t.Errorf("%s lost partition %d when m2 left: %v, then %v", m, p, a, b)
			}
		}
	}
	// m4 joins 3 members: it takes one partition from each (12/4 = 3), the others keep 3 of 4.
	c := assignSticky([]string{"m1", "m2", "m3", "m4"}, parts(12), prev(1, "m1", "m2", "m3"))
	checkAssignment(t, c, []string{"m1", "m2", "m3", "m4"}, 12)
	moved := 0
	for _, m := range []string{"m1", "m2", "m3"} {
		for _, p := range a[m] {
			if !slices.Contains(c[m], p) {
				moved++
			}
		}
	}
	if moved != 3 {
		t.Errorf("%d partitions moved when a 4th member joined, want 3: %v, then %v", moved, a, c)
	}
	// Uneven: 5 partitions, 3 members, then 2: within one.
	d := assignSticky([]string{"x", "y", "z"}, parts(5), nil)
	checkAssignment(t, d, []string{"x", "y", "z"}, 5)
	e := assignSticky([]string{"x", "z"}, parts(5), map[string]memberData{"x": {Owned: d["x"]}, "z": {Owned: d["z"]}})
	checkAssignment(t, e, []string{"x", "z"}, 5)
	// More members than partitions: some get none.
	checkAssignment(t, assignSticky([]string{"a", "b", "c", "d"}, parts(2), nil), []string{"a", "b", "c", "d"}, 2)
}

func TestAssignStickyLaterGenerationWins(t *testing.T) {
	// m1 was evicted after generation 3, when it owned 0 and 1; m2 got them in generation 4.
	prev := map[string]memberData{
		"m1": {Owned: []int{0, 1}, Generation: 3},
		"m2": {Owned: []int{0, 1, 2}, Generation: 4},
		"m3": {Owned: []int{3, 4, 5}, Generation: 4},
	}
	got := assignSticky([]string{"m1", "m2", "m3"}, parts(6), prev)
	checkAssignment(t, got, []string{"m1", "m2", "m3"}, 6)
	if !slices.Equal(got["m2"], []int{0, 1}) || !slices.Equal(got["m3"], []int{3, 4}) {
		t.Fatalf("the latest generation's claims should be kept: %v", got)
	}
	// And through the GroupBalancer interface, with UserData as members send it.
	refused := map[string]int{}
	bal := &stickyBalancer{topic: "ce", keys: testKeys(), refused: func(member string, err error) {
		if !errors.Is(err, clusterkey.ErrUnauthenticated) {
			t.Errorf("member %s refused with %v, want an ErrUnauthenticated", member, err)
		}
		refused[member]++
	}}
	var members []kafka.GroupMember
	for _, id := range []string{"m1", "m2", "m3"} {
		d := prev[id]
		d.Replica = "r-" + id
		ud, err := encodeMemberData(testKeys(), d)
		if err != nil {
			t.Fatal(err)
		}
		members = append(members, kafka.GroupMember{ID: id, Topics: []string{"ce"}, UserData: ud})
	}
	// Two members outside the cluster, claiming every partition at a later generation: one
	// with unsigned data, one signed with another key. They get nothing, and change nothing.
	unsigned, _ := json.Marshal(memberData{Replica: "evil", URL: "http://evil.test", Owned: parts(6), Generation: 9})
	other, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	forged, _ := encodeMemberData(other, memberData{Replica: "evil", URL: "http://evil.test", Owned: parts(6), Generation: 9})
	members = append(members, kafka.GroupMember{ID: "x-unsigned", Topics: []string{"ce"}, UserData: unsigned},
		kafka.GroupMember{ID: "x-forged", Topics: []string{"ce"}, UserData: forged})
	var kp []kafka.Partition
	for p := range 6 {
		kp = append(kp, kafka.Partition{Topic: "ce", ID: p})
	}
	for range 2 {
		ga := bal.AssignGroups(members, kp)
		if fmt.Sprint(ga["m1"]["ce"], ga["m2"]["ce"], ga["m3"]["ce"]) != fmt.Sprint(got["m1"], got["m2"], got["m3"]) {
			t.Errorf("AssignGroups %v, assignSticky %v", ga, got)
		}
		if a, b := ga["x-unsigned"]["ce"], ga["x-forged"]["ce"]; len(a) != 0 || len(b) != 0 {
			t.Errorf("members outside the cluster were given %v and %v", a, b)
		}
	}
	if refused["x-unsigned"] != 1 || refused["x-forged"] != 1 || len(refused) != 2 {
		t.Errorf("refusals reported %v, want each outsider once", refused)
	}
}

func equalAssign(a, b map[string][]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !slices.Equal(a[k], b[k]) {
			return false
		}
	}
	return true
}
