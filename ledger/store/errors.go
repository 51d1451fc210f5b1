package store

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// Errors. Every error about a damaged file is a *CorruptError (wrapping ErrCorrupt) that names the
// file.
var (
	// ErrCorrupt: the ledger file is damaged or is not a ledger. Nothing was written to it.
	ErrCorrupt = errors.New("ledger corrupt")
	// ErrLocked: another process (or another Open in this one) holds the ledger.
	ErrLocked = errors.New("ledger locked")
	// ErrWrite: a transaction could not be made durable (no space, file size limit, failed
	// fsync). Nothing of it is visible: the file was reread and is as before the call.
	// Retry later; the daemon pauses.
	ErrWrite = errors.New("ledger write failed")
	// ErrClosed: the File was closed.
	ErrClosed = errors.New("ledger closed")
)

// CorruptError reports a damaged ledger file: which file, what is wrong, and how to recover.
// cfguard never writes to a file it found damaged.
type CorruptError struct {
	Path   string
	Detail error
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("%v: %s: %s. %s", ErrCorrupt, e.Path, Reason(e.Detail), recoveryHint(e.Path))
}

// Unwrap makes errors.Is(err, ErrCorrupt) hold, and exposes the detail.
func (e *CorruptError) Unwrap() []error { return []error{ErrCorrupt, e.Detail} }

// Reason says what is wrong: an error made by Corruptf without its "ledger corrupt: " prefix, any
// other error as it is.
func Reason(err error) string {
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
		"holds (not from the consumer group's committed offsets)", q, ShellQuote(AsideName(path, ".damaged")))
}

// AsideName is the name a recovery instruction moves path aside to: path+suffix, or, when that
// exists (a file set aside by an earlier recovery), path+suffix+"-2", "-3", ..., the first that
// does not, so that the printed mv does not replace a file.
func AsideName(path, suffix string) string {
	name := path + suffix
	for n := 2; ; n++ {
		if _, err := os.Lstat(name); err != nil {
			return name
		}
		name = fmt.Sprintf("%s%s-%d", path, suffix, n)
	}
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

// Corruptf makes an error about a damaged record or page, wrapping ErrCorrupt. InFile names the
// file it was found in.
func Corruptf(format string, args ...any) error {
	return &recordError{msg: fmt.Sprintf(format, args...)}
}

// InRecord prefixes what record a decode error is about, keeping an error made by Corruptf one.
func InRecord(err error, format string, args ...any) error {
	if err == nil {
		return nil
	}
	var re *recordError
	if errors.As(err, &re) {
		return &recordError{msg: fmt.Sprintf(format, args...) + ": " + re.msg}
	}
	return fmt.Errorf(format+": %w", append(args, err)...)
}

// InFile turns an error that wraps ErrCorrupt into a *CorruptError naming path (once). Other
// errors, and nil, are returned as they are.
func InFile(path string, err error) error {
	if err == nil || !errors.Is(err, ErrCorrupt) {
		return err
	}
	var ce *CorruptError
	if errors.As(err, &ce) {
		return err
	}
	return &CorruptError{Path: path, Detail: err}
}
