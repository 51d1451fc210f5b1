package replica

import (
	"encoding/json"
	"slices"
	"sync"

	"github.com/segmentio/kafka-go"
)

// updaterProtocol is the updater group's protocol with updaterBalancer. Members offer kafka-go's
// range and round-robin balancers after it, so a group that still holds a member of a build
// without it agrees on range (the coordinator picks a protocol every member offers).
const updaterProtocol = "cfguard-updater-sticky-v1"

// updaterData is a member's UserData in the updater group.
type updaterData struct {
	// Led is the latest generation that assigned this member the posterior topic's partition
	// (0: none since it started).
	Led int32 `json:"led"`
	// SteppedDown is set once the member gave the role up (its entry lost, or a term it could
	// not hold): the balancer gives the role to another member if there is one.
	SteppedDown bool `json:"stepped_down,omitempty"`
}

// updaterBalancer keeps the updater role where it is. The role is the posterior topic's one
// partition; each member says in its UserData the latest generation that gave it the role, and
// the group's leader gives the role to the member that held it last, unless that member stepped
// down. Without such a member, the role goes to the first member by id. A membership change
// then moves the role only when its holder leaves or gives it up, so the log gets no claim and
// ingest no change of process at every join (kafka-go's range balancer gives the one partition
// to the member id that sorts last, which a joining member's random id may be).
type updaterBalancer struct {
	topic string

	mu   sync.Mutex
	data updaterData
	// noTopic: the last assignment this member computed, as the group's leader, found no
	// partition of the topic (deleted, not yet created again), so it gave nobody the role.
	noTopic bool
}

// assignedWithoutTopic reports whether this member, leading the group, found no partition of
// the topic when it assigned the generation that just began, and forgets it.
func (b *updaterBalancer) assignedWithoutTopic() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	no := b.noTopic
	b.noTopic = false
	return no
}

// led records that generation gen assigned this member the role (assigned) or not. A member not
// assigned it says nothing at the next join: it neither holds the role nor gave it up, and a
// generation number from before the group emptied (generations start again from 1) cannot
// outbid the holder's.
func (b *updaterBalancer) led(gen int32, assigned bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.data = updaterData{}
	if assigned {
		b.data.Led = gen
	}
}

// steppedDown records that this member gave the role up.
func (b *updaterBalancer) steppedDown() {
	b.mu.Lock()
	b.data.SteppedDown = true
	b.mu.Unlock()
}

func (b *updaterBalancer) ProtocolName() string { return updaterProtocol }

func (b *updaterBalancer) UserData() ([]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return json.Marshal(b.data)
}

func (b *updaterBalancer) AssignGroups(members []kafka.GroupMember, partitions []kafka.Partition) kafka.GroupMemberAssignments {
	var parts []int
	for _, p := range partitions {
		if p.Topic == b.topic {
			parts = append(parts, p.ID)
		}
	}
	out := kafka.GroupMemberAssignments{}
	data := map[string]updaterData{}
	var ids []string
	for _, m := range members {
		if !slices.Contains(m.Topics, b.topic) {
			continue
		}
		var d updaterData
		if json.Unmarshal(m.UserData, &d) != nil {
			d = updaterData{}
		}
		ids, data[m.ID] = append(ids, m.ID), d
		out[m.ID] = map[string][]int{b.topic: {}}
	}
	if to := pickUpdater(ids, data); to != "" {
		out[to][b.topic] = parts
	}
	b.mu.Lock()
	b.noTopic = len(parts) == 0
	b.mu.Unlock()
	return out
}

// pickUpdater is the member to give the role to: among the members that did not step down (all
// of them when every one did), the one assigned it in the latest generation, else the first by
// id. It is deterministic: whichever member leads the group computes the same.
func pickUpdater(ids []string, data map[string]updaterData) string {
	ids = slices.Sorted(slices.Values(ids))
	candidates := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return data[id].SteppedDown })
	if len(candidates) == 0 {
		candidates = ids
	}
	if len(candidates) == 0 {
		return ""
	}
	best := candidates[0]
	for _, id := range candidates[1:] {
		if data[id].Led > data[best].Led {
			best = id
		}
	}
	return best
}
