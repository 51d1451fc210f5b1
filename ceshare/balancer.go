package ceshare

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"sync"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/clusterkey"
)

// protocolName is the group protocol of the sticky balancer, with signed member data (v1's was
// not signed). Every member of the group must offer it: the coordinator refuses a member of a
// build that offers only another (kafka.InconsistentGroupProtocol), which waits until the
// group's members of the other build are gone.
const protocolName = "cfguard-sticky-v2"

// memberData is a member's UserData in the group: who it is, where its API is, and what it
// owned in the last generation it took part in.
type memberData struct {
	Replica string `json:"replica"`
	URL     string `json:"url"`
	Owned   []int  `json:"owned"`
	// Generation is the generation Owned was assigned in: when two members claim a partition
	// (one was evicted without knowing it), the later generation's claim wins.
	Generation int32 `json:"generation"`
}

// MemberDomain separates the authenticator of a member's UserData from those of the topics'
// records.
const MemberDomain = "cfguard ce member v1"

// signedData is a member's UserData: memberData's JSON and its authenticator under the
// cluster's key. Anyone the broker lets join the group can offer this protocol; a member whose
// data does not authenticate is given no partition by the balancer, and is no owner to the
// Directory, so that no client's token nor any question goes to the URL it names.
type signedData struct {
	Data json.RawMessage `json:"data"`
	Auth string          `json:"auth"`
}

func encodeMemberData(keys *clusterkey.Keyring, d memberData) ([]byte, error) {
	raw, err := json.Marshal(d)
	if err != nil {
		return nil, err
	}
	return json.Marshal(signedData{Data: raw, Auth: string(keys.Sign(MemberDomain, raw))})
}

// decodeMemberData returns the member data of UserData b; an error when b is not signed member
// data that authenticates under keys.
func decodeMemberData(keys *clusterkey.Keyring, b []byte) (memberData, error) {
	var sd signedData
	if err := json.Unmarshal(b, &sd); err != nil || len(sd.Data) == 0 {
		return memberData{}, fmt.Errorf("%w: its group metadata is not cfguard's signed member data", clusterkey.ErrUnauthenticated)
	}
	if err := keys.Verify(MemberDomain, sd.Data, []byte(sd.Auth)); err != nil {
		return memberData{}, err
	}
	var d memberData
	if err := json.Unmarshal(sd.Data, &d); err != nil || d.Replica == "" {
		return memberData{}, fmt.Errorf("%w: its member data does not decode", ErrDecode)
	}
	return d, nil
}

// stickyBalancer is a kafka-go GroupBalancer that keeps partitions where they were. Each
// member puts in its UserData the partitions it owned; the group leader (whichever member it
// is) lets every member keep its previous partitions up to its share, and gives the rest to
// the members below their share. Shares differ by one at most: with n members and P
// partitions, P mod n members own ceil(P/n), the others floor(P/n); the members that kept
// the most get the larger shares, so a rebalance moves only the partitions that must move.
type stickyBalancer struct {
	topic   string
	replica string
	url     string
	keys    *clusterkey.Keyring
	// refused is called, once per member id, for a member whose data does not authenticate:
	// it is given no partition.
	refused func(member string, err error)

	mu         sync.Mutex
	owned      []int           // what this member owns, sent as UserData at the next join
	generation int32           // the generation that assigned owned
	seen       map[string]bool // members refused already (the leader's AssignGroups only)
}

func (b *stickyBalancer) setOwned(parts []int, generation int32) {
	b.mu.Lock()
	b.owned, b.generation = slices.Clone(parts), generation
	b.mu.Unlock()
}

func (b *stickyBalancer) ProtocolName() string { return protocolName }

func (b *stickyBalancer) UserData() ([]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return encodeMemberData(b.keys, memberData{Replica: b.replica, URL: b.url, Owned: b.owned, Generation: b.generation})
}

func (b *stickyBalancer) AssignGroups(members []kafka.GroupMember, partitions []kafka.Partition) kafka.GroupMemberAssignments {
	var parts []int
	for _, p := range partitions {
		if p.Topic == b.topic {
			parts = append(parts, p.ID)
		}
	}
	var ids []string
	prev := make(map[string]memberData, len(members))
	out := make(kafka.GroupMemberAssignments, len(members))
	b.forgetGone(members)
	for _, m := range members {
		if !slices.Contains(m.Topics, b.topic) {
			continue
		}
		d, err := decodeMemberData(b.keys, m.UserData)
		if err != nil {
			out[m.ID] = map[string][]int{b.topic: {}}
			b.refuse(m.ID, err)
			continue
		}
		ids = append(ids, m.ID)
		prev[m.ID] = d
	}
	for id, got := range assignSticky(ids, parts, prev) {
		out[id] = map[string][]int{b.topic: got}
	}
	return out
}

// forgetGone drops the refused members that are no longer in the group.
func (b *stickyBalancer) forgetGone(members []kafka.GroupMember) {
	b.mu.Lock()
	defer b.mu.Unlock()
	keepOnly(b.seen, func(id string) bool {
		return slices.ContainsFunc(members, func(m kafka.GroupMember) bool { return m.ID == id })
	})
}

// keepOnly deletes from set the member ids that are not present (no longer in the group), so that
// a set of members refused once does not grow with every id that came and went.
func keepOnly(set map[string]bool, present func(id string) bool) {
	for id := range set {
		if !present(id) {
			delete(set, id)
		}
	}
}

func (b *stickyBalancer) refuse(member string, err error) {
	b.mu.Lock()
	first := !b.seen[member]
	if b.seen == nil {
		b.seen = map[string]bool{}
	}
	b.seen[member] = true
	b.mu.Unlock()
	if first && b.refused != nil {
		b.refused(member, err)
	}
}

// assignSticky shares parts out to members (ids), keeping each member's previous partitions
// (prev[id].Owned) as far as balance to within one allows. It is deterministic: the same
// input gives the same assignment whichever member leads.
func assignSticky(members []string, parts []int, prev map[string]memberData) map[string][]int {
	out := make(map[string][]int, len(members))
	if len(members) == 0 {
		return out
	}
	members = slices.Sorted(slices.Values(members))
	parts = slices.Sorted(slices.Values(parts))
	exists := make(map[int]bool, len(parts))
	for _, p := range parts {
		exists[p] = true
	}
	// A partition two members claim (one of them was evicted and did not know) stays with
	// the claim of the latest generation, then the first member in id order; a partition that
	// no longer exists is dropped.
	claimed := make(map[int]string, len(parts))
	for _, m := range members {
		for _, p := range prev[m].Owned {
			if c := claimed[p]; exists[p] && (c == "" || prev[m].Generation > prev[c].Generation) {
				claimed[p] = m
			}
		}
	}
	kept := make(map[string][]int, len(members))
	for _, p := range parts {
		if m := claimed[p]; m != "" {
			kept[m] = append(kept[m], p)
		}
	}
	// Shares: the members that kept the most get the P mod n larger shares.
	order := slices.Clone(members)
	slices.SortStableFunc(order, func(a, b string) int { return cmp.Compare(len(kept[b]), len(kept[a])) })
	base, extra := len(parts)/len(members), len(parts)%len(members)
	quota := make(map[string]int, len(members))
	for i, m := range order {
		quota[m] = base
		if i < extra {
			quota[m]++
		}
	}
	taken := make(map[int]bool, len(parts))
	for _, m := range members {
		k := kept[m]
		if len(k) > quota[m] {
			k = k[:quota[m]]
		}
		out[m] = slices.Clone(k)
		for _, p := range k {
			taken[p] = true
		}
	}
	// The rest, in partition order, to the members furthest below their share.
	for _, p := range parts {
		if taken[p] {
			continue
		}
		best := ""
		for _, m := range members {
			if len(out[m]) < quota[m] && (best == "" || quota[m]-len(out[m]) > quota[best]-len(out[best])) {
				best = m
			}
		}
		out[best] = append(out[best], p)
	}
	for m := range out {
		slices.Sort(out[m])
	}
	return out
}
