package hashing

import (
	"encoding/binary"
	"unsafe"
)

// littleEndian reports whether uint32s are stored little-endian, so that a
// token slice's memory already is the content pass's byte image of it.
var littleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// putTokens writes tokens into b as uint32 LE. On a little-endian machine
// that is a copy of the tokens' memory (one memmove per block, about a
// fifth of the time of the stores it replaces); elsewhere two tokens per
// 8-byte store, since 4-byte stores made the hash's 8-byte loads about
// three times slower.
func putTokens(b []byte, tokens []uint32) {
	if len(tokens) == 0 {
		return
	}
	if littleEndian {
		copy(b, unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens)))
		return
	}
	putTokensStores(b, tokens)
}

// putTokensStores is putTokens on any machine.
func putTokensStores(b []byte, tokens []uint32) {
	j := 0
	for ; j+1 < len(tokens); j += 2 {
		binary.LittleEndian.PutUint64(b[4*j:], uint64(tokens[j])|uint64(tokens[j+1])<<32)
	}
	if j < len(tokens) {
		binary.LittleEndian.PutUint32(b[4*j:], tokens[j])
	}
}
