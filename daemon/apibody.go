package daemon

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"os"
	"path"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/stream"
)

// writeJSON answers v as JSON with code. v is encoded before the status line goes out, so that a
// value JSON cannot hold (a NaN) is a 500 that says so, not a 200 with an empty body.
func writeJSON(w http.ResponseWriter, code int, v any) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		code, buf = http.StatusInternalServerError, bytes.Buffer{}
		json.NewEncoder(&buf).Encode(map[string]string{"error": "encoding the answer: " + err.Error()})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(buf.Bytes()) // the status line is out; a client that went away is not ours to report
}

// writeError answers {"error": msg}. A server error's message is stripped of server paths
// (see publicMessage); the daemon's log has them.
func writeError(w http.ResponseWriter, code int, msg string) {
	if code >= 500 {
		msg = publicMessage(msg)
	}
	writeJSON(w, code, map[string]string{"error": ident.Clip(msg, maxErrorMessage)})
}

// absPath matches an absolute file path that starts a word (after a space, a bracket, a quote,
// "=" or the start): the file system's layout is the server's, not a client's business.
var absPath = regexp.MustCompile(`(^|[\s(\[{'"=])(/[^\s'"()\[\]{},;]+)`)

// publicMessage replaces every absolute path in msg by its last element ("cfguard.db"); the
// daemon's own routes ("see /readyz") are not files and stay as they are.
func publicMessage(msg string) string {
	return absPath.ReplaceAllStringFunc(msg, func(m string) string {
		i := strings.IndexByte(m, '/')
		switch p := strings.TrimRight(m[i:], ".:"); {
		case p == "/readyz", p == "/healthz", p == "/metrics", strings.HasPrefix(p, "/v1/"), strings.HasPrefix(p, "/ui/"):
			return m
		}
		return m[:i] + path.Base(m[i:])
	})
}

// retryLater answers 429 or 409 with Retry-After (whole seconds, at least 1).
func retryLater(w http.ResponseWriter, code int, after time.Duration, msg string) {
	setRetryAfter(w, after)
	writeError(w, code, msg)
}

// setRetryAfter sets the Retry-After header to after, in whole seconds, at least 1.
func setRetryAfter(w http.ResponseWriter, after time.Duration) {
	w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(after.Seconds())))))
}

// writePending answers 202 for a registration a replica sent to the owner of its CE's partition,
// which has not stored it yet (cluster.ErrPending err): GET its Location later. more adds fields.
func writePending(w http.ResponseWriter, id string, err error, more map[string]any) {
	body := pendingBody(id, err)
	maps.Copy(body, more)
	w.Header().Set("Location", "/v1/counterfactuals/"+id)
	writeJSON(w, http.StatusAccepted, body)
}

// pendingBody is a 202's body for a request on CE id that its owner has not applied yet (err
// matches cluster.ErrPending): with the partition and offset of the CE topic where it landed.
func pendingBody(id string, err error) map[string]any {
	body := map[string]any{"id": id, "status": "pending", "detail": err.Error()}
	if pe := (*cluster.PendingError)(nil); errors.As(err, &pe) {
		body["partition"], body["offset"] = pe.Partition, pe.Offset
	}
	return body
}

// bodyError is a request body that cannot be used: code is its HTTP status.
type bodyError struct {
	code int
	msg  string
}

func (e *bodyError) Error() string { return e.msg }

// writeBodyError answers a decodeBody error with its status.
func writeBodyError(w http.ResponseWriter, err error) {
	code := http.StatusBadRequest
	var be *bodyError
	if errors.As(err, &be) {
		code = be.code
	}
	writeError(w, code, err.Error())
}

// decodeBody reads the request body (bounded by http.max_body_bytes and, through the server,
// by http.read_timeout) and decodes one JSON object into v, a pointer to a struct, strictly:
// unknown fields, anything after the value, and what encoding/json would let through in
// silence (checkKeys) are errors that name the field.
func decodeBody(r *http.Request, v any) error {
	body, err := readBody(r)
	if err != nil {
		return err
	}
	return decodeJSON(body, v)
}

// readBody reads the request body, bounded as decodeBody says.
func readBody(r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(r.Body)
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return nil, &bodyError{http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes (http.max_body_bytes)", mbe.Limit)}
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, &bodyError{http.StatusRequestTimeout, "request body not received within the server's http.read_timeout"}
	case err != nil:
		return nil, &bodyError{http.StatusBadRequest, "reading the request body: " + err.Error()}
	}
	return body, nil
}

// decodeJSON decodes one JSON object into v strictly (see decodeBody).
func decodeJSON(body []byte, v any) error {
	switch trimmed := bytes.TrimSpace(body); {
	case len(trimmed) == 0:
		return &bodyError{http.StatusBadRequest, "bad JSON: the body is empty: send a JSON object {...}"}
	case bytes.HasPrefix(trimmed, []byte("\xef\xbb\xbf")):
		return &bodyError{http.StatusBadRequest, "bad JSON: the body starts with a UTF-8 byte order mark: send the JSON object without it"}
	case trimmed[0] != '{':
		return &bodyError{http.StatusBadRequest, fmt.Sprintf("bad JSON: the body must be a JSON object {...}, not %s", stream.JSONKind(trimmed))}
	}
	if err := checkKeys(body, reflect.TypeOf(v).Elem()); err != nil {
		return &bodyError{http.StatusBadRequest, jsonMessage(err)}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return &bodyError{http.StatusBadRequest, jsonMessage(err)}
	}
	if _, err := dec.Token(); err != io.EOF {
		return &bodyError{http.StatusBadRequest, "bad JSON: trailing data after the request body's JSON value"}
	}
	return nil
}

// valueError is a field's value that is well-formed JSON but not one the field takes (an empty
// id, a method no one knows), from a request type's UnmarshalJSON: jsonMessage says what the
// field takes without calling the body bad JSON.
type valueError struct{ msg string }

func (e *valueError) Error() string { return e.msg }

func valueErrorf(format string, args ...any) error {
	return &valueError{fmt.Sprintf(format, args...)}
}

// jsonMessage says what is wrong with a body (or a bulk line) encoding/json refused: where a
// syntax error is (its byte offset in what was decoded), and which field holds a value of the
// wrong type (in JSON's terms, not Go's), with the value cut short (a 1 MB number is not echoed
// back).
func jsonMessage(err error) string {
	var (
		se *json.SyntaxError
		te *json.UnmarshalTypeError
		ve *valueError
	)
	switch {
	case errors.As(err, &ve):
		return ident.Clip(ve.msg, maxErrorMessage)
	case errors.As(err, &se):
		return fmt.Sprintf("bad JSON at byte %d: %s", se.Offset, clipValue(se.Error()))
	case errors.As(err, &te) && te.Field != "":
		return fmt.Sprintf("bad JSON: field %q: %s is not %s", clipValue(te.Field), clipValue(te.Value), jsonKindOf(te.Type))
	case errors.As(err, &te):
		return fmt.Sprintf("bad JSON: %s is not %s", clipValue(te.Value), jsonKindOf(te.Type))
	}
	return "bad JSON: " + ident.Clip(err.Error(), maxErrorMessage)
}

// jsonKindOf names in JSON's terms what a Go type of the request bodies decodes from.
func jsonKindOf(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return fmt.Sprintf("a whole number from 0 to %d", uint64(math.MaxUint64)>>(64-t.Bits()))
	case reflect.Pointer:
		return jsonKindOf(t.Elem())
	case reflect.Float32, reflect.Float64:
		return "a finite number of 64 bits (about ±1.8e308)"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		if k := t.Elem().Kind(); k == reflect.Float32 || k == reflect.Float64 {
			return "an array of numbers"
		}
		return "an array"
	}
	return "the value the field takes"
}

// clipValue cuts s, a value from a request, to at most maxEcho bytes, so that an answer never
// echoes a huge input back.
func clipValue(s string) string { return ident.Clip(s, maxEcho) }

const (
	// maxEcho bounds what of a request's value an error message repeats.
	maxEcho = 128
	// maxErrorMessage bounds an error answer's message, whatever of the request it repeats.
	maxErrorMessage = 4096
)

// checkKeys refuses, in a JSON object decoded into struct type t, what encoding/json accepts in
// silence: a key given twice (the last would win), at any depth; a key that names a field only
// by case folding ("X" for "x"); and null for a field or in it (it would leave the zero value:
// "target": null would be class 0, [1, null] would be [1, 0]). A body that is not a JSON
// object is left to the decoder to report.
func checkKeys(body []byte, t reflect.Type) error {
	fields := jsonFields(t)
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		key, _ := tok.(string)
		if seen[key] {
			return fmt.Errorf("duplicate key %q", key)
		}
		seen[key] = true
		if !slices.Contains(fields, key) {
			for _, f := range fields {
				if strings.EqualFold(f, key) {
					return fmt.Errorf("unknown field %q (keys are case-sensitive: did you mean %q?)", clipValue(key), f)
				}
			}
			if len(fields) == 0 {
				return fmt.Errorf("unknown field %q (this body takes no fields: send {} or no body)", clipValue(key))
			}
			return fmt.Errorf("unknown field %q (fields: %s)", clipValue(key), strings.Join(fields, ", "))
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil
		}
		if string(raw) == "null" {
			return valueErrorf("%q is null: give it a value or leave it out", key)
		}
		if bytes.Contains(raw, []byte("null")) && hasNull(raw) { // [1, null] would be [1, 0]
			return valueErrorf("%q holds a null: give every element a value", key)
		}
		if bytes.IndexByte(raw, '{') >= 0 { // a nested object (or a string holding a brace)
			if err := noDuplicateKeys(raw); err != nil {
				return fmt.Errorf("in %q: %w", key, err)
			}
		}
	}
	return nil
}

// hasNull reports whether a JSON value holds a null at any depth (a syntax error is left to the
// decoder).
func hasNull(raw []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(raw))
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		if tok == nil {
			return true
		}
	}
}

// noDuplicateKeys reports the first key given twice in one object of a JSON value.
func noDuplicateKeys(raw []byte) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	var objects []map[string]bool // keys of the open objects; nil for an open array
	expectKey := func() bool { return len(objects) > 0 && objects[len(objects)-1] != nil }
	valueNext := false // the last token was a key
	for {
		tok, err := dec.Token()
		if err != nil {
			return nil // io.EOF, or a syntax error the decoder will report
		}
		switch tok {
		case json.Delim('{'):
			objects, valueNext = append(objects, map[string]bool{}), false
			continue
		case json.Delim('['):
			objects, valueNext = append(objects, nil), false
			continue
		case json.Delim('}'), json.Delim(']'):
			objects, valueNext = objects[:len(objects)-1], false
			continue
		}
		if key, ok := tok.(string); ok && expectKey() && !valueNext {
			if objects[len(objects)-1][key] {
				return fmt.Errorf("duplicate key %q", key)
			}
			objects[len(objects)-1][key], valueNext = true, true
			continue
		}
		valueNext = false
	}
}

// jsonFields are the JSON names of struct type t's fields.
func jsonFields(t reflect.Type) []string {
	var names []string
	for f := range t.Fields() {
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch name {
		case "-":
			continue
		case "":
			name = f.Name
		}
		names = append(names, name)
	}
	return names
}
