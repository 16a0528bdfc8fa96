package forge

import (
	"testing"
	"time"
)

// A kept listing is reused within its time to live and kept current from
// the driver's own changes; a listing read across a change is not kept,
// and a change of unknown outcome drops it.
func TestKept(t *testing.T) {
	var k Kept
	if _, ok, _ := k.Get(time.Minute); ok {
		t.Fatal("an empty Kept returned a listing")
	}
	_, _, stamp := k.Get(time.Minute)
	if !k.Keep([]Runner{{ID: 1, Name: "a-1"}}, stamp, time.Now(), true) {
		t.Fatal("a listing read with no change meanwhile was not kept")
	}
	k.Change(2, func(l []Runner, i int) []Runner { return append(l, Runner{ID: 2, Name: "a-2"}) })
	k.Set(1, StatusBusy)
	list, ok, _ := k.Get(time.Minute)
	if !ok || len(list) != 2 || list[0].Status != StatusBusy {
		t.Fatalf("kept %v %v, want a-1 busy and a-2", list, ok)
	}
	k.Forget(2)
	if list, _, _ := k.Get(time.Minute); len(list) != 1 {
		t.Fatalf("kept %v after forgetting a-2", list)
	}
	if _, ok, _ := k.Get(0); ok {
		t.Error("a listing older than its time to live was reused")
	}
	// A change while a listing is read: that listing is not kept.
	_, _, stamp = k.Get(0)
	k.Change(3, nil)
	if k.Keep([]Runner{{ID: 1}}, stamp, time.Now(), true) {
		t.Error("a listing read across a change was kept")
	}
	if _, ok, _ := k.Get(time.Minute); ok {
		t.Error("a listing read across a change is reused")
	}
	_, _, stamp = k.Get(time.Minute)
	k.Keep([]Runner{{ID: 1}}, stamp, time.Now(), true)
	k.Drop()
	if _, ok, _ := k.Get(time.Minute); ok {
		t.Error("a dropped listing is reused")
	}
	_, _, stamp = k.Get(time.Minute)
	if k.Keep([]Runner{{ID: 1}}, stamp, time.Now(), false) {
		t.Error("kept though told not to")
	}
}
