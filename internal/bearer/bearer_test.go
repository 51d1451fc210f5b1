package bearer

import "testing"

func TestToken(t *testing.T) {
	for _, c := range []struct {
		header, token string
		ok            bool
	}{
		{"Bearer t0ken", "t0ken", true},
		{"bearer t0ken", "t0ken", true},
		{"BEARER t0ken", "t0ken", true},
		{"Bearer ", "", true}, // an empty token, which matches no configured one
		{"Bearer  t0ken", " t0ken", true},
		{"Bearert0ken", "", false},
		{"Basic dTpw", "", false},
		{"Bearer", "", false},
		{"t0ken", "", false},
		{"", "", false},
	} {
		if token, ok := Token(c.header); token != c.token || ok != c.ok {
			t.Errorf("Token(%q) = %q, %v; want %q, %v", c.header, token, ok, c.token, c.ok)
		}
	}
}
