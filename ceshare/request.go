package ceshare

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/ident"
)

// Domain separates the CE topic's authenticators from those of other records (clusterkey):
// a request's authenticator never verifies as a posterior log entry's.
const Domain = "cfguard ce request v1"

// Sign is the authenticator of a request's value bytes (Encode's) under keys' signing key, the
// value of its record's clusterkey.Header header.
func Sign(keys *clusterkey.Keyring, value []byte) []byte { return keys.Sign(Domain, value) }

// Authenticate checks the authenticator auth of a record's value under keys. The key of the
// record is covered through the value: Decode refuses a key that is not the value's id.
func Authenticate(keys *clusterkey.Keyring, value, auth []byte) error {
	return keys.Verify(Domain, value, auth)
}

// Request kinds.
const (
	KindRegister = "register"
	KindDelete   = "delete"
)

// Request is one record of the CE topic: its key is the CE id, its value the JSON of Request.
//
// What older builds need of a newer format: the same Domain (a value signed under another is,
// to them, a forgery: left out), and the id as a string field "id", equal to the record's key.
// Then an older build blocks its partition at the request (Member, Blocked) instead of leaving
// it out, until a build that reads it owns the partition.
type Request struct {
	// Kind is KindRegister or KindDelete.
	Kind string `json:"kind"`
	// ID is the CE's id (ident.Check); the record's key.
	ID string `json:"id"`
	// CE is, for a registration, the CE as the registering replica measured it (the daemon's
	// ledger record, as JSON); it is opaque here. A deletion carries none.
	CE json.RawMessage `json:"ce,omitempty"`
	// Replica is the id of the replica that accepted the request.
	Replica string `json:"replica"`
	// At is when that replica accepted it.
	At time.Time `json:"at"`
	// RID identifies the request: an owner applies a request of a given RID once, however many
	// times the CE topic holds it (a producer's retry of a write that landed), and records its
	// outcome under it (the answer the accepting replica gives). A registration or deletion
	// with an Idempotency-Key has the RID the key derives, so a client's retry with the key is
	// the same request. Empty in requests written before RIDs existed: those are applied each
	// time.
	RID string `json:"rid,omitempty"`
	// Fingerprint is, for a request with an Idempotency-Key, the SHA-256 of what the client sent
	// (hex): a request whose RID was applied with another fingerprint is the key reused for
	// another request, and is not applied.
	Fingerprint string `json:"fingerprint,omitempty"`
	// IfMatch is, for a deletion sent with an If-Match header, the tags of the registrations it
	// may delete (ledger.CE.Tag, or "*" for any): its owner keeps a CE stored with another tag.
	// Absent: the deletion deletes whatever the id holds. A build that predates it blocks the
	// partition at such a request rather than delete unconditionally.
	IfMatch []string `json:"if_match,omitempty"`

	// Offset is where the request was read in its partition (set by Member, not encoded).
	Offset int64 `json:"-"`
	// State is, for a registration read while its partition is rebuilt (MemberConfig.StateTopic), the state
	// a previous owner wrote for its CE on the CE state topic (set by Member, not encoded), nil
	// for none. The caller judges whether it is a state of this registration's CE.
	State *State `json:"-"`
	// Restored marks a registration the member rebuilt from State alone (set by Member, not
	// encoded): the partition's first requests were deleted before this member read them, and
	// State is a CE's state a previous owner wrote. ID and State are set; CE, At and RID are
	// not (the CE and its registration time are in State.CE); Offset is where the deleted
	// requests begin.
	Restored bool `json:"-"`
}

// MaxRIDLen bounds a request's RID.
const MaxRIDLen = 128

// MaxIfMatch bounds how many tags a deletion's IfMatch names (each at most MaxRIDLen bytes).
const MaxIfMatch = 16

// Reasons a record of the CE topic is refused by Decode, as DecodeError.Reason. They label
// MemberStats.Skipped (ReasonKey, ReasonPartition and ReasonUnauthenticated: a member skips only
// those) and Blocked.Reason (the others).
const (
	ReasonJSON    = "json"    // the value is not a JSON object of Request's fields
	ReasonKind    = "kind"    // Kind is neither register nor delete
	ReasonID      = "id"      // ID is not a valid id
	ReasonKey     = "key"     // the record's key is not ID
	ReasonCE      = "ce"      // a registration without a CE object, or a deletion with one
	ReasonReplica = "replica" // Replica is empty
	ReasonAt      = "at"      // At is missing
	ReasonRID     = "rid"     // RID or Fingerprint is too long or holds bytes other than printable ASCII
	// ReasonIfMatch: IfMatch on a registration, more than MaxIfMatch tags, or a tag that is
	// empty, too long or holds bytes other than printable ASCII.
	ReasonIfMatch = "if_match"
	// ReasonPartition: the request's ID belongs to another partition (Partition): a request
	// copied there, which its partition's owner would apply a second time, out of its order.
	ReasonPartition = "partition"
	// ReasonUnauthenticated: the record's authenticator is missing or does not verify under
	// the cluster's keys (MemberConfig.Keys); the record is not decoded.
	ReasonUnauthenticated = "unauthenticated"
)

// Reasons lists every DecodeError.Reason, so that counters can start at 0.
func Reasons() []string {
	return []string{ReasonJSON, ReasonKind, ReasonID, ReasonKey, ReasonCE, ReasonReplica, ReasonAt, ReasonRID, ReasonIfMatch, ReasonPartition, ReasonUnauthenticated}
}

// ErrDecode is matched (errors.Is) by every DecodeError.
var ErrDecode = errors.New("ceshare: malformed request")

// DecodeError says why a record of the CE topic is not a Request.
type DecodeError struct {
	Reason string // one of Reasons
	Detail string
}

func (e *DecodeError) Error() string {
	return "ceshare: malformed request: " + e.Reason + ": " + e.Detail
}

// Is makes errors.Is(err, ErrDecode) hold.
func (e *DecodeError) Is(target error) bool { return target == ErrDecode }

// Encode checks r and returns the record's key and value.
func Encode(r Request) (key, value []byte, err error) {
	if err := r.check(); err != nil {
		return nil, nil, err
	}
	value, err = json.Marshal(r)
	if err != nil {
		return nil, nil, &DecodeError{Reason: ReasonCE, Detail: err.Error()}
	}
	return []byte(r.ID), value, nil
}

// Decode parses one record of the CE topic. A record whose value is not a valid Request, or
// whose key is not the request's ID, is refused with a *DecodeError.
func Decode(key, value []byte) (Request, error) {
	var r Request
	if err := decodeStrict(value, &r); err != nil {
		return Request{}, err
	}
	if err := r.check(); err != nil {
		return Request{}, err
	}
	if string(key) != r.ID {
		return Request{}, &DecodeError{Reason: ReasonKey, Detail: fmt.Sprintf("key %q is not the id %q", clip(key), r.ID)}
	}
	return r, nil
}

// decodeStrict decodes value, one JSON object of v's fields and nothing else, into v; any other
// value is a *DecodeError of ReasonJSON.
func decodeStrict(value []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(value))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return &DecodeError{Reason: ReasonJSON, Detail: err.Error()}
	}
	if dec.More() {
		return &DecodeError{Reason: ReasonJSON, Detail: "data after the JSON object"}
	}
	return nil
}

func (r *Request) check() error {
	switch r.Kind {
	case KindRegister:
		if len(r.CE) == 0 || r.CE[0] != '{' || !json.Valid(r.CE) {
			return &DecodeError{Reason: ReasonCE, Detail: "a registration needs the CE as a JSON object"}
		}
	case KindDelete:
		if len(r.CE) != 0 && string(r.CE) != "null" {
			return &DecodeError{Reason: ReasonCE, Detail: "a deletion carries no CE"}
		}
	default:
		return &DecodeError{Reason: ReasonKind, Detail: fmt.Sprintf("kind %q: want %q or %q", clip([]byte(r.Kind)), KindRegister, KindDelete)}
	}
	if err := ident.Check(r.ID); err != nil {
		return &DecodeError{Reason: ReasonID, Detail: err.Error()}
	}
	if r.Replica == "" {
		return &DecodeError{Reason: ReasonReplica, Detail: "no replica named"}
	}
	if r.At.IsZero() {
		return &DecodeError{Reason: ReasonAt, Detail: "no time of acceptance"}
	}
	for name, v := range map[string]string{"rid": r.RID, "fingerprint": r.Fingerprint} {
		if !printable(v, MaxRIDLen) {
			return &DecodeError{Reason: ReasonRID, Detail: fmt.Sprintf("%s %q: want at most %d printable ASCII bytes", name, clip([]byte(v)), MaxRIDLen)}
		}
	}
	switch {
	case r.IfMatch != nil && r.Kind != KindDelete:
		return &DecodeError{Reason: ReasonIfMatch, Detail: "only a deletion names the registrations it applies to"}
	case len(r.IfMatch) > MaxIfMatch:
		return &DecodeError{Reason: ReasonIfMatch, Detail: fmt.Sprintf("%d tags: want at most %d", len(r.IfMatch), MaxIfMatch)}
	}
	for _, tag := range r.IfMatch {
		if tag == "" || !printable(tag, MaxRIDLen) {
			return &DecodeError{Reason: ReasonIfMatch, Detail: fmt.Sprintf("tag %q: want 1 to %d printable ASCII bytes", clip([]byte(tag)), MaxRIDLen)}
		}
	}
	return nil
}

// printable says whether s is at most max bytes of printable ASCII.
func printable(s string, max int) bool {
	if len(s) > max {
		return false
	}
	for i := range len(s) {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// clip shortens bytes quoted in an error to 160 bytes (ident.Clip).
func clip(b []byte) string { return ident.Clip(string(b), 160) }
