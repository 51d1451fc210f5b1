package stream

import "testing"

func TestJSONKindNamesWhatItSees(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`"a"`, "a string"}, {`{}`, "an object"}, {`[1]`, "an array"}, {`true`, "a boolean"}, {`false `, "a boolean"},
		{`null`, "null"}, {`-1`, "a number"}, {`7`, "a number"}, {``, "end of input"},
		{`txt`, `byte 't'`}, {`nope`, `byte 'n'`}, {`not json`, `byte 'n'`}, {`fals`, `byte 'f'`}, {"\x00", `byte '\x00'`},
	} {
		if got := JSONKind([]byte(tc.in)); got != tc.want {
			t.Errorf("JSONKind(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}
