// Package clusterkey authenticates the records replicas write to Kafka (the posterior log's
// entries, the CE topic's requests) with HMAC-SHA-256 under a key the replicas share.
//
// A key file (replication.key_file) holds one key a line, "<id>:<hex>", with at least 32 bytes
// of key; blank lines and lines starting with '#' are ignored. The first key signs, every key
// verifies, so that a key is rotated by adding the new one, then moving it first. An
// authenticator is "<id>:<64 hex digits>", the HMAC-SHA-256 of
//
//	domain || 0x00 || id || 0x00 || value
//
// where value is the record's value exactly as stored (the bytes that decide state, not a
// re-encoding of them) and domain names the kind of record, so that an authenticator of one kind
// never verifies another.
package clusterkey

import (
	"bufio"
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"slices"
	"strings"

	"github.com/cfguard/cfguard/internal/ident"
)

// MinKeyBytes is the shortest key accepted: HMAC-SHA-256's output length (RFC 2104 discourages
// keys shorter than it).
const MinKeyBytes = 32

// MaxKeys bounds the keys of one file.
const MaxKeys = 16

// Header is the name of the Kafka record header that carries the authenticator.
const Header = "cfguard-auth"

// GenerateCommand is how an operator makes a key file, named in every refusal.
const GenerateCommand = "cfguard gen-key --id k1 > cluster.key (or: printf 'k1:%s\\n' \"$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')\" > cluster.key)"

var idPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

type key struct {
	id     string
	secret []byte
}

// Keyring is a cluster's keys: the first signs, every one verifies. It is safe for concurrent use.
type Keyring struct {
	keys   []key
	source string
}

// ErrUnauthenticated is matched (errors.Is) by every error of Verify.
var ErrUnauthenticated = errors.New("not authenticated by the cluster key")

// UnknownKeyError is Verify's error for an authenticator under a key id the keyring does not
// hold: a record of another cluster, a forger's, or one signed under a key removed from this
// file while records signed with it are still read. It matches ErrUnauthenticated.
type UnknownKeyError struct {
	// ID is the authenticator's key id (clipped to 64 bytes).
	ID     string
	source string
	ids    []string
}

func (e *UnknownKeyError) Error() string {
	return fmt.Sprintf("%v: key id %q is not in %s (its keys: %s)", ErrUnauthenticated, e.ID, e.source, strings.Join(e.ids, ", "))
}

func (e *UnknownKeyError) Unwrap() error { return ErrUnauthenticated }

// UnknownKeys tallies the failed authentications that are UnknownKeyErrors: how many records
// were signed under key ids a keyring lacks, and the first few of those ids, for an error that
// names them.
type UnknownKeys struct {
	Records int
	ids     []string
}

// maxUnknownIDs bounds the key ids an UnknownKeys lists.
const maxUnknownIDs = 8

// Add counts err, an authentication's failure, when it is an UnknownKeyError.
func (u *UnknownKeys) Add(err error) {
	var uk *UnknownKeyError
	if !errors.As(err, &uk) {
		return
	}
	u.Records++
	if !slices.Contains(u.ids, uk.ID) && len(u.ids) < maxUnknownIDs {
		u.ids = append(u.ids, uk.ID)
	}
}

// String lists the key ids counted, in the order first seen ("" when none).
func (u *UnknownKeys) String() string { return strings.Join(u.ids, ", ") }

// Load reads the key file at path. Its errors name the file (and line) and what to do: how to
// make a key file, or, for one of too many keys, which keys to remove.
func Load(path string) (*Keyring, error) {
	if path == "" {
		return nil, fmt.Errorf("replication.key_file is empty: replicas authenticate what they write to Kafka with a key they share; "+
			"make one with %s, give every replica the same file, and set replication.key_file (or CFGUARD_REPLICATION_KEY_FILE)", GenerateCommand)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("replication.key_file: %w (make one with %s and give every replica the same file)", err, GenerateCommand)
	}
	return Parse(b, path)
}

// Exposed reports whether the key file at path can be read or written by every user of the
// machine (its permission bits for others), with its permissions; false when it cannot be
// stated. A key file is a secret: whoever reads it can write records every replica accepts.
func Exposed(path string) (fs.FileMode, bool) {
	st, err := os.Stat(path)
	if err != nil {
		return 0, false
	}
	return st.Mode().Perm(), st.Mode().Perm()&0o006 != 0
}

// Parse reads a key file's contents; source names it in errors.
func Parse(data []byte, source string) (*Keyring, error) {
	k := &Keyring{source: source}
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		id, hx, ok := strings.Cut(line, ":")
		bad := func(why string) error {
			return fmt.Errorf("replication.key_file %s:%d: %s; a line is \"<id>:<hex key of at least %d bytes>\" (make one with %s)",
				source, n, why, MinKeyBytes, GenerateCommand)
		}
		if !ok {
			return nil, bad("no ':' between the key id and the key")
		}
		if !idPattern.MatchString(id) {
			return nil, bad(fmt.Sprintf("key id %q: want 1 to 64 of A-Z a-z 0-9 . _ -", id))
		}
		if seen[id] {
			return nil, bad(fmt.Sprintf("key id %q appears twice", id))
		}
		secret, err := hex.DecodeString(hx)
		if err != nil {
			return nil, bad("the key is not hex")
		}
		if len(secret) < MinKeyBytes {
			return nil, bad(fmt.Sprintf("key %q has %d bytes, want at least %d", id, len(secret), MinKeyBytes))
		}
		seen[id] = true
		k.keys = append(k.keys, key{id: id, secret: secret})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("replication.key_file %s: %w; a line is \"<id>:<hex key of at least %d bytes>\" (make one with %s)",
			source, err, MinKeyBytes, GenerateCommand)
	}
	switch {
	case len(k.keys) == 0:
		return nil, fmt.Errorf("replication.key_file %s holds no key (make one with %s)", source, GenerateCommand)
	case len(k.keys) > MaxKeys:
		return nil, fmt.Errorf("replication.key_file %s holds %d keys, at most %d: remove keys that signed nothing the topics still hold", source, len(k.keys), MaxKeys)
	}
	return k, nil
}

// Generate returns a key file's line for a new random key named id.
func Generate(id string) (string, error) {
	if !idPattern.MatchString(id) {
		return "", fmt.Errorf("key id %q: want 1 to 64 of A-Z a-z 0-9 . _ -", id)
	}
	b := make([]byte, MinKeyBytes)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return id + ":" + hex.EncodeToString(b) + "\n", nil
}

// Source is the file the keys were read from.
func (k *Keyring) Source() string { return k.source }

// IDs are the key ids, the signing one first.
func (k *Keyring) IDs() []string {
	out := make([]string, len(k.keys))
	for i, kk := range k.keys {
		out[i] = kk.id
	}
	return out
}

func mac(secret []byte, domain, id string, value []byte) []byte {
	h := hmac.New(sha256.New, secret)
	h.Write([]byte(domain))
	h.Write([]byte{0})
	h.Write([]byte(id))
	h.Write([]byte{0})
	h.Write(value)
	return h.Sum(nil)
}

// Sign returns the authenticator of value in domain under the signing key.
func (k *Keyring) Sign(domain string, value []byte) []byte {
	kk := k.keys[0]
	m := mac(kk.secret, domain, kk.id, value)
	out := make([]byte, 0, len(kk.id)+1+2*len(m))
	out = append(out, kk.id...)
	out = append(out, ':')
	return hex.AppendEncode(out, m)
}

// Verify checks auth, an authenticator of value in domain, against every key. Its errors match
// ErrUnauthenticated and say why: none, an unknown key id, or a MAC that does not match. A nil
// Keyring verifies nothing.
func (k *Keyring) Verify(domain string, value, auth []byte) error {
	if len(auth) == 0 {
		return fmt.Errorf("%w: no %s header", ErrUnauthenticated, Header)
	}
	id, hx, ok := bytes.Cut(auth, []byte(":"))
	if !ok {
		return fmt.Errorf("%w: %s header is not \"<key id>:<hex>\"", ErrUnauthenticated, Header)
	}
	if k == nil {
		return fmt.Errorf("%w: no key to verify it with", ErrUnauthenticated)
	}
	got := make([]byte, hex.DecodedLen(len(hx)))
	if n, err := hex.Decode(got, hx); err != nil || n != sha256.Size {
		return fmt.Errorf("%w: %s header's MAC is not %d hex bytes", ErrUnauthenticated, Header, sha256.Size)
	}
	for _, kk := range k.keys {
		if kk.id == string(id) {
			if !hmac.Equal(got, mac(kk.secret, domain, kk.id, value)) {
				return fmt.Errorf("%w: the MAC under key %q does not match", ErrUnauthenticated, kk.id)
			}
			return nil
		}
	}
	return &UnknownKeyError{ID: clip(id), source: k.source, ids: k.IDs()}
}

// clip shortens a key id quoted in an error to 64 bytes (ident.Clip).
func clip(b []byte) string { return ident.Clip(string(b), 64) }
