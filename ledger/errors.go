package ledger

import (
	"errors"
	"fmt"

	"github.com/cfguard/cfguard/ledger/store"
)

// Errors. Every error about bad input wraps ErrInvalid and names the field; every error about a
// damaged file is a *CorruptError (wrapping ErrCorrupt) that names the file.
var (
	ErrInvalid        = errors.New("invalid input")
	ErrNotFound       = errors.New("counterfactual not found")
	ErrExists         = errors.New("counterfactual id already stored")
	ErrNoPosterior    = errors.New("no current posterior (checkpoint a model first)")
	ErrUnknownAnchor  = errors.New("anchor posterior not stored")
	ErrVersion        = errors.New("posterior version does not advance")
	ErrNotRecertified = errors.New("posterior change without a matching re-certification")
	// ErrStale: the store changed (CEs registered, deleted, audited or confirmed, or a new
	// current posterior) between Recertify and the write; nothing was written; run it again.
	ErrStale = errors.New("re-certification is stale")
	// ErrOrigin: a checkpoint names a different first posterior than the one stored.
	ErrOrigin = errors.New("posterior origin differs from the stored one")
)

// OriginError is Open's refusal of a ledger whose first posterior came from another origin than
// Options.Origin. Open wrote nothing for the Policy before it (errors.Is(err, ErrOrigin) holds).
type OriginError struct {
	Have string // the origin the ledger records
	Want string // Options.Origin
}

func (e *OriginError) Error() string {
	return fmt.Sprintf("ledger: the first posterior came from %s, the configuration names %s", e.Have, e.Want)
}

func (e *OriginError) Unwrap() error { return ErrOrigin }

// Errors of the file, from package store (the same values, so errors.Is holds either way).
var (
	// ErrCorrupt: the ledger file is damaged or is not a ledger. Nothing was written to it.
	ErrCorrupt = store.ErrCorrupt
	// ErrLocked: another process (or another Open in this one) holds the ledger.
	ErrLocked = store.ErrLocked
	// ErrWrite: a transaction could not be made durable (no space, file size limit, failed
	// fsync). Nothing of it is visible: the ledger reread the file and is as before the call.
	// Retry later; the daemon pauses.
	ErrWrite = store.ErrWrite
	// ErrClosed: the Ledger was closed.
	ErrClosed = store.ErrClosed
)

// ErrNewerSchema: the file is a ledger (or a backup) of a newer cfguard: its schema is past
// what this build reads. It is not damaged; the cfguard that wrote it opens or restores it.
var ErrNewerSchema = errors.New("a ledger of a newer cfguard")

// CorruptError reports a damaged ledger file: which file, what is wrong, and how to recover.
// cfguard never writes to a file it found damaged.
type CorruptError = store.CorruptError

// RecoveryConfigPlaceholder is what recovery instructions print for the daemon's configuration
// file; a caller that knows it replaces the placeholder.
const RecoveryConfigPlaceholder = store.RecoveryConfigPlaceholder

// ShellQuote quotes s for a POSIX shell when it holds anything but letters, digits and ./_-+:@%,=.
func ShellQuote(s string) string { return store.ShellQuote(s) }

// corrupt turns an error that wraps ErrCorrupt into a *CorruptError naming path (once).
func corrupt(path string, err error) error { return store.InFile(path, err) }

// invalidf makes an error wrapping ErrInvalid.
func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
}
