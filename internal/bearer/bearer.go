// Package bearer reads the token of an HTTP Authorization header of the Bearer scheme
// (RFC 6750, section 2.1). The scheme's name is case-insensitive (RFC 9110, section 11.1):
// "bearer t" and "BEARER t" carry the token t as "Bearer t" does.
package bearer

import "strings"

// Token is the token of the Authorization header value h when h is "Bearer <token>", the scheme
// in any case; ok is false, and the token empty, for another scheme or no header.
func Token(h string) (token string, ok bool) {
	scheme, token, found := strings.Cut(h, " ")
	if !found || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	return token, true
}
