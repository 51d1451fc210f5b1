package ledger

import (
	"errors"
	"fmt"
	"strings"
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
	// ErrCorrupt: the ledger file is damaged or is not a ledger. Nothing was written to it.
	ErrCorrupt = errors.New("ledger corrupt")
	// ErrLocked: another process (or another Open in this one) holds the ledger.
	ErrLocked = errors.New("ledger locked")
	// ErrWrite: a transaction could not be made durable (no space, file size limit, failed
	// fsync). Nothing of it is visible: the ledger reread the file and is as before the call.
	// Retry later; the daemon pauses.
	ErrWrite = errors.New("ledger write failed")
	// ErrOrigin: a checkpoint names a different first posterior than the one stored.
	ErrOrigin = errors.New("posterior origin differs from the stored one")
	// ErrClosed: the Ledger was closed.
	ErrClosed = errors.New("ledger closed")
)

// CorruptError reports a damaged ledger file: which file, what is wrong, and how to recover.
// cfguard never writes to a file it found damaged.
type CorruptError struct {
	Path   string
	Detail error
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("%v: %s: %s. %s", ErrCorrupt, e.Path, detailText(e.Detail), recoveryHint(e.Path))
}

// Unwrap makes errors.Is(err, ErrCorrupt) hold, and exposes the detail.
func (e *CorruptError) Unwrap() []error { return []error{ErrCorrupt, e.Detail} }

// detailText drops the "ledger corrupt: " prefix of details that wrap ErrCorrupt themselves.
func detailText(err error) string {
	var re *recordError
	if errors.As(err, &re) && re == err {
		return re.msg
	}
	return err.Error()
}

// recoveryHint says how to get a working ledger back from a damaged file, as commands that work
// when pasted into a shell. CONFIG and BACKUP are the daemon's configuration file and a file
// written by cfguard backup (cfguard run puts its own --config in place of CONFIG).
func recoveryHint(path string) string {
	q := ShellQuote(path)
	return fmt.Sprintf("cfguard wrote nothing to it. To recover, stop cfguard and move the file aside "+
		"(mv %s %s), then either restore a backup (cfguard restore --config CONFIG --from BACKUP, which verifies it "+
		"first) and start cfguard, or start cfguard without restoring one to start over: it bootstraps its model again, every stored "+
		"counterfactual is lost, and it reads each partition of kafka.topic from the earliest offset the broker still "+
		"holds (not from the consumer group's committed offsets)", q, ShellQuote(path+".damaged"))
}

// RecoveryConfigPlaceholder is what recovery instructions print for the daemon's configuration
// file; a caller that knows it replaces the placeholder.
const RecoveryConfigPlaceholder = "--config CONFIG"

// ShellQuote quotes s for a POSIX shell when it holds anything but letters, digits and ./_-+:@%,=.
func ShellQuote(s string) string {
	safe := s != ""
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("./_-+:@%,=", r)) {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// recordError is a damaged record or page, found while decoding; it wraps ErrCorrupt. Its
// message names the record (counterfactual "id", posterior version N, anchor N, ...).
type recordError struct{ msg string }

func (e *recordError) Error() string        { return ErrCorrupt.Error() + ": " + e.msg }
func (e *recordError) Is(target error) bool { return target == ErrCorrupt }

// corruptf makes a recordError.
func corruptf(format string, args ...any) error {
	return &recordError{msg: fmt.Sprintf(format, args...)}
}

// inRecord prefixes what record a decode error is about, keeping it a recordError.
func inRecord(err error, format string, args ...any) error {
	if err == nil {
		return nil
	}
	var re *recordError
	if errors.As(err, &re) {
		return &recordError{msg: fmt.Sprintf(format, args...) + ": " + re.msg}
	}
	return fmt.Errorf(format+": %w", append(args, err)...)
}

// corrupt turns an error that wraps ErrCorrupt into a *CorruptError naming path (once).
func corrupt(path string, err error) error {
	if err == nil || !errors.Is(err, ErrCorrupt) {
		return err
	}
	var ce *CorruptError
	if errors.As(err, &ce) {
		return err
	}
	return &CorruptError{Path: path, Detail: err}
}

// invalidf makes an error wrapping ErrInvalid.
func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
}
