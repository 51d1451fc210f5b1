package ceshare

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// A replica that acquires a partition afresh (also one it kept through generations that went by
// without it: another member may have claimed it meanwhile) claims it on the CE state topic
// before it reads the partition's requests: a claim record names the partition, the replica, the
// CE group generation it was given the partition in, and a term one past the greatest term of
// the partition's claims it read. The partition is in the signed value, so a claim copied into
// another partition is no claim there (DecodeClaim). Of the claims a reader has read, the one in
// force is the greatest by (term, generation): terms grow with every claim that read the ones
// before it, and the generation breaks a tie between two replicas that claimed without seeing
// each other's claim (the later generation was given the partition last). Terms, not
// generations, order claims because generations start again from 1 when the group is removed
// (every replica stopped).
//
// A state is the owner's when no claim was read before it, or when the claim in force names its
// writer and a generation no later than the state's. Any other state is a previous owner's late
// write (a paused process, or an outbox published after a restart): a reader keeps the CE's
// state from before it. Compaction may have removed that one; the late write is then the CE's
// only state and the reader takes it, as it would without claims (a state is a claim the new
// owner checks and judges again).

// ClaimDomain separates a claim's authenticator from a state's, a request's and an entry's.
const ClaimDomain = "cfguard ce state claim v1"

// ReasonTerm is the DecodeError.Reason of a claim whose term is below 1 (claims only: it is not
// among Reasons, which label the CE topic's refusals).
const ReasonTerm = "term"

// claimPrefix starts the key of every claim record ("claim/<term>"): a CE id cannot hold '/'
// (ident.Check), so no claim shares a key with a CE, and compaction keeps every claim.
const claimPrefix = "claim/"

// Claim is a claim record of the CE state topic (its value's JSON).
type Claim struct {
	// Partition is the partition of the CE state topic (and of the CE topic) claimed.
	Partition int `json:"partition"`
	// Term is one past the greatest term of the partition's claims its writer read (from 1).
	Term int64 `json:"term"`
	// Replica is the id of the replica that claims the partition.
	Replica string `json:"replica"`
	// Generation is the CE group generation that gave it the partition.
	Generation int32 `json:"generation"`
}

// isClaim says whether a record's key is a claim's.
func isClaim(key []byte) bool { return bytes.HasPrefix(key, []byte(claimPrefix)) }

// EncodeClaim checks c and returns the record's key and value.
func EncodeClaim(c Claim) (key, value []byte, err error) {
	if err := c.check(); err != nil {
		return nil, nil, err
	}
	value, err = json.Marshal(c)
	return []byte(claimPrefix + strconv.FormatInt(c.Term, 10)), value, err
}

// DecodeClaim parses a claim record read in partition p; a value that is not a valid Claim, a
// key that is not its term's, or a claim of another partition than p (or of none) is refused
// with a *DecodeError.
func DecodeClaim(p int, key, value []byte) (Claim, error) {
	c := Claim{Partition: -1} // stays -1 when the value names no partition
	if err := decodeStrict(value, &c); err != nil {
		return Claim{}, err
	}
	if c.Partition == -1 {
		return Claim{}, &DecodeError{Reason: ReasonPartition, Detail: "the claim names no partition (an earlier build wrote it); it is not read, and the partition is fenced from its next claim on"}
	}
	if c.Partition != p {
		return Claim{}, &DecodeError{Reason: ReasonPartition, Detail: fmt.Sprintf("a claim of partition %d read in partition %d: a copy", c.Partition, p)}
	}
	if err := c.check(); err != nil {
		return Claim{}, err
	}
	if want := claimPrefix + strconv.FormatInt(c.Term, 10); string(key) != want {
		return Claim{}, &DecodeError{Reason: ReasonKey, Detail: fmt.Sprintf("key %q is not %q", clip(key), want)}
	}
	return c, nil
}

func (c *Claim) check() error {
	switch {
	case c.Partition < 0:
		return &DecodeError{Reason: ReasonPartition, Detail: fmt.Sprintf("partition %d", c.Partition)}
	case c.Term < 1:
		return &DecodeError{Reason: ReasonTerm, Detail: fmt.Sprintf("term %d: want 1 or more", c.Term)}
	case strings.TrimSpace(c.Replica) == "":
		return &DecodeError{Reason: ReasonReplica, Detail: "no replica named"}
	}
	return nil
}

// after says whether c is in force over o: a greater term, or the same term in a later
// generation (a claim read later wins a full tie).
func (c Claim) after(o Claim) bool {
	if c.Term != o.Term {
		return c.Term > o.Term
	}
	return c.Generation >= o.Generation
}

// owns says whether a state is its writer's as owner of the partition under claim c: c names
// the writer, and the state is of c's generation or a later one (a state of an earlier
// generation, read after c, was written before the claim and published late).
func (c Claim) owns(s State) bool {
	return s.Replica == c.Replica && s.Generation >= c.Generation
}
