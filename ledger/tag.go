package ledger

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"
)

// Tag identifies the registration that stored the CE: the first 16 bytes, in hex, of the
// SHA-256 of its id, creation time (Unix nanoseconds), target, x and x_cf (each float's IEEE-754
// bits). Every ledger that holds the CE computes the same tag (a replica that takes a CE over
// keeps its creation time), and a CE deleted and registered again under the same id has
// another, even with the same x, x_cf and target. The API serves it as the CE's ETag; a
// deletion conditioned on it (DeleteRequest's ifMatch) deletes only that registration.
func (c *CE) Tag() string {
	h := sha256.New()
	var b [8]byte
	word := func(u uint64) {
		binary.BigEndian.PutUint64(b[:], u)
		h.Write(b[:])
	}
	word(uint64(len(c.ID)))
	h.Write([]byte(c.ID))
	word(uint64(c.CreatedAt.UnixNano()))
	word(uint64(int64(c.Target)))
	for _, v := range [][]float64{c.X, c.XCF} {
		word(uint64(len(v)))
		for _, f := range v {
			word(math.Float64bits(f))
		}
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// AnyTag in a deletion's ifMatch matches whichever CE is stored (HTTP's If-Match: *).
const AnyTag = "*"

// IsTag reports whether s has the form of a registration's tag (CE.Tag): 32 lower-case hex
// digits. A string that has not names no registration.
func IsTag(s string) bool {
	if len(s) != 32 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
