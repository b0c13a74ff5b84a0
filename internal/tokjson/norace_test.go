//go:build !race

package tokjson

const raceEnabled = false
