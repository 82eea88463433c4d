"""Recent: a small table of what repeated calls reuse (checked calls, masks, kernel launches, schedules, tensor
maps), the least recently used dropped beyond its size. Safe to share between threads."""
import threading
from collections import OrderedDict


class Recent:
    """Values by key, at most ``size`` of them: ``get`` (None if absent) and ``put`` (returns the value) mark a
    key the most recently used; ``made(key, make)`` is get, else put(make()). With ``tags``, each value is put with
    a tag (what it holds on to: a mask's device bounds) and at most ``tags`` tags are kept, the values of the least
    recently used tag dropped together."""

    def __init__(self, size, tags=None):
        self.size, self.tags = size, tags
        self.kept = OrderedDict()
        self.tagged = OrderedDict()   # tag -> keys put with it
        self.tag_of = {}
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            value = self.kept.get(key)
            if value is not None:
                self.kept.move_to_end(key)
                if self.tags is not None:
                    self.tagged.move_to_end(self.tag_of[key])
            return value

    def put(self, key, value, tag=None):
        with self.lock:
            self.kept[key] = value
            self.kept.move_to_end(key)
            if self.tags is not None:
                self._untag(key)
                self.tag_of[key] = tag
                self.tagged.setdefault(tag, set()).add(key)
                self.tagged.move_to_end(tag)
                while len(self.tagged) > self.tags:
                    for old in self.tagged.popitem(last=False)[1]:
                        self.kept.pop(old, None)
                        self.tag_of.pop(old, None)
            while len(self.kept) > self.size:
                self._untag(self.kept.popitem(last=False)[0])
            return value

    def _untag(self, key):
        tag = self.tag_of.pop(key, None)
        if key in self.tagged.get(tag, ()):
            self.tagged[tag].discard(key)
            if not self.tagged[tag]:
                del self.tagged[tag]

    def made(self, key, make):
        value = self.get(key)
        return self.put(key, make()) if value is None else value

    def clear(self):
        with self.lock:
            self.kept.clear()
            self.tagged.clear()
            self.tag_of.clear()

    def __len__(self):
        return len(self.kept)
