package ceshare

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
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
	unsigned, err := json.Marshal(memberData{Replica: "evil", URL: "http://evil.test", Owned: parts(6), Generation: 9})
	if err != nil {
		t.Fatal(err)
	}
	other, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	forged, err := encodeMemberData(other, memberData{Replica: "evil", URL: "http://evil.test", Owned: parts(6), Generation: 9})
	if err != nil {
		t.Fatal(err)
	}
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

// assignStickyCases are inputs of assignSticky with ties: shares that do not divide evenly,
// members that kept as many partitions as each other, and two claims of one partition at one
// generation.
var assignStickyCases = []struct {
	name    string
	members []string
	parts   []int
	prev    map[string]memberData
}{
	{"first generation, uneven", []string{"m1", "m2", "m3"}, parts(5), nil},
	{"a new member beside two", []string{"m1", "m2", "m3"}, parts(7),
		map[string]memberData{"m1": {Owned: []int{0, 2, 4}, Generation: 2}, "m3": {Owned: []int{1, 3, 5, 6}, Generation: 2}}},
	{"one partition claimed twice in one generation", []string{"m1", "m2"}, parts(4),
		map[string]memberData{"m1": {Owned: []int{0, 1}, Generation: 3}, "m2": {Owned: []int{1, 2, 3}, Generation: 3}}},
}

// assignSticky is deterministic: the same members, partitions and previous ownership give the
// same assignment in whatever order the leader lists the members and the partitions (kafka-go
// hands them in the order the group and the metadata have them).
func TestAssignStickyIgnoresTheOrderOfItsInput(t *testing.T) {
	for _, tc := range assignStickyCases {
		t.Run(tc.name, func(t *testing.T) {
			want := assignSticky(tc.members, tc.parts, tc.prev)
			checkAssignment(t, want, tc.members, len(tc.parts))
			for shift := range len(tc.members) {
				members := append(slices.Clone(tc.members[shift:]), tc.members[:shift]...)
				for _, ps := range [][]int{slices.Clone(tc.parts), reversed(tc.parts)} {
					ps = append(ps[shift%len(ps):], ps[:shift%len(ps)]...)
					if got := assignSticky(members, ps, tc.prev); !equalAssign(got, want) {
						t.Errorf("members %v, partitions %v: %v; in sorted order: %v", members, ps, got, want)
					}
				}
			}
		})
	}
}

func reversed(s []int) []int {
	out := slices.Clone(s)
	slices.Reverse(out)
	return out
}

// A partition two members claim at the same generation stays with the first of them in id
// order, and the members that kept the most partitions get the larger shares, so that the
// fewest partitions move.
func TestAssignStickyBreaksTiesByIDAndKeepsTheMost(t *testing.T) {
	// m1 and m2 both claim 1 at generation 3: m1, the first in id order, keeps it.
	tc := assignStickyCases[2]
	got := assignSticky(tc.members, tc.parts, tc.prev)
	first := slices.Min(tc.members)
	if !slices.Contains(got[first], 1) {
		t.Errorf("partition 1, claimed by %v at one generation, went elsewhere than to %s: %v", tc.members, first, got)
	}
	// m1 owned 3 of 7, m3 owned 4, m2 joins: the shares are 3, 2 and 2, and the larger goes to
	// m3, which kept the most; each keeps as many of its own as its share allows.
	tc = assignStickyCases[1]
	got = assignSticky(tc.members, tc.parts, tc.prev)
	checkAssignment(t, got, tc.members, len(tc.parts))
	n, k := len(tc.parts), len(tc.members)
	most := ""
	for m, d := range tc.prev {
		if most == "" || len(d.Owned) > len(tc.prev[most].Owned) {
			most = m
		}
	}
	for m, d := range tc.prev {
		share := n / k
		if m == most {
			share = (n + k - 1) / k
		}
		kept := 0
		for _, p := range d.Owned {
			if slices.Contains(got[m], p) {
				kept++
			}
		}
		if want := min(len(d.Owned), share); kept != want || len(got[m]) != share {
			t.Errorf("%s has %d partitions and kept %d of its %v; want a share of %d, %d of them its own: %v", m, len(got[m]), kept, d.Owned, share, want, got)
		}
	}
}

// AssignGroups shares out the partitions of the CE topic alone, to the members that subscribe
// to it: the partitions of another topic a member of the group subscribes to (anyone the broker
// lets in may offer more topics) are not CE partitions. A member refused once is reported again
// only after it left the group, and the balancer forgets it then.
func TestAssignGroupsKeepsToItsTopic(t *testing.T) {
	keys := testKeys()
	var refused []string
	bal := &stickyBalancer{topic: "ce", keys: keys, refused: func(member string, _ error) { refused = append(refused, member) }}
	signed := func(d memberData) []byte {
		ud, err := encodeMemberData(keys, d)
		if err != nil {
			t.Fatal(err)
		}
		return ud
	}
	members := []kafka.GroupMember{
		{ID: "m1", Topics: []string{"ce"}, UserData: signed(memberData{Replica: "r1", Owned: []int{0, 1}, Generation: 1})},
		{ID: "m2", Topics: []string{"ce"}, UserData: signed(memberData{Replica: "r2", Generation: 1})},
		{ID: "m-elsewhere", Topics: []string{"other"}, UserData: signed(memberData{Replica: "r9", Owned: []int{2}, Generation: 1})},
	}
	outsider := kafka.GroupMember{ID: "x", Topics: []string{"ce", "other"}, UserData: []byte(`{}`)}
	var kp []kafka.Partition
	for p := range 4 {
		kp = append(kp, kafka.Partition{Topic: "ce", ID: p})
	}
	for p := range 9 {
		kp = append(kp, kafka.Partition{Topic: "other", ID: p})
	}
	want := assignSticky([]string{"m1", "m2"}, parts(4), map[string]memberData{
		"m1": {Replica: "r1", Owned: []int{0, 1}, Generation: 1}, "m2": {Replica: "r2", Generation: 1}})
	for i, ms := range [][]kafka.GroupMember{append(slices.Clone(members), outsider), members, append(slices.Clone(members), outsider)} {
		ga := bal.AssignGroups(ms, kp)
		for _, m := range ms {
			if got := ga[m.ID]["ce"]; !slices.Equal(got, want[m.ID]) {
				t.Errorf("round %d: %s assigned %v, want %v (the CE topic's partitions shared by its subscribers)", i, m.ID, got, want[m.ID])
			}
			if got := ga[m.ID]["other"]; len(got) != 0 {
				t.Errorf("round %d: %s assigned partitions %v of another topic", i, m.ID, got)
			}
		}
		if i == 1 && len(bal.seen) != 0 {
			t.Errorf("the balancer remembers %v, which left the group", bal.seen)
		}
	}
	if !slices.Equal(refused, []string{"x", "x"}) {
		t.Errorf("refusals %v, want x at its first join and again when it came back", refused)
	}
}

// A member's UserData carries what it owned and the generation that assigned it (the later
// generation's claim wins), and member data that does not name a replica is refused even
// when it authenticates: the Directory would answer with an owner of no replica id.
func TestMemberDataCarriesItsGeneration(t *testing.T) {
	keys := testKeys()
	bal := &stickyBalancer{topic: "ce", replica: "r1", url: "http://r1.test:8080", keys: keys}
	owned, gen := []int{1, 4, 7}, int32(12)
	bal.setOwned(owned, gen)
	ud, err := bal.UserData()
	if err != nil {
		t.Fatal(err)
	}
	d, err := decodeMemberData(keys, ud)
	if err != nil {
		t.Fatal(err)
	}
	if want := (memberData{Replica: "r1", URL: "http://r1.test:8080", Owned: owned, Generation: gen}); !reflect.DeepEqual(d, want) {
		t.Errorf("UserData decodes as %+v, want %+v", d, want)
	}
	nameless, err := encodeMemberData(keys, memberData{URL: "http://r1.test:8080", Owned: owned, Generation: gen})
	if err != nil {
		t.Fatal(err)
	}
	if d, err := decodeMemberData(keys, nameless); err == nil {
		t.Errorf("member data naming no replica decodes as %+v", d)
	}
}
