// Library outputs recycled between calls of a compiled graph (runtime/arena.py).
//
// A oneDNN convolution or any other torch op a plan calls allocates its output through
// torch's CPU allocator, i.e. malloc; glibc maps blocks above its mmap threshold (at most
// 32 MiB) afresh on every allocation and hands freed heap back to the OS, so every call
// faults those pages in again. This allocator wraps torch's: on a thread inside a compiled
// call (an arena entered), blocks of at least kMinBytes come from the arena's cache of
// blocks freed before (the one freed last that fits, if under twice the size); everywhere
// else it passes every request to the allocator it replaced. A freed block goes back to
// its arena's cache while the cache holds less than one call's worth of allocations (the
// most one call took from it), else to the OS.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <pthread.h>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kMinBytes = 64 << 10;  // below this malloc's heap serves without faults
constexpr size_t kGranule = 4096;       // sizes rounded up to pages, so near sizes share
constexpr size_t kAlign = 64;           // torch's CPU alignment (c10/core/alignment.h)

struct Arena {
  std::mutex mu;  // guards every field below
  std::vector<std::pair<size_t, void*>> cache;  // freed blocks (size, address), oldest first
  size_t cached = 0;      // bytes in `cache`
  size_t call_bytes = 0;  // bytes handed out since the last enter
  size_t limit = 0;       // the most bytes one call took: the cache holds at most this
  size_t live = 0, peak = 0;  // bytes handed out and not yet back; their most
  size_t refs = 1;        // the handle, and one per block handed out
  bool closed = false;
  uint64_t fresh = 0, reused = 0;
};

struct Block {
  Arena* arena;
  size_t size;
};

std::mutex table_mu;
// every block handed out, by address; never freed: deleters may run at exit
std::unordered_map<void*, Block>* table = new std::unordered_map<void*, Block>();
thread_local Arena* active = nullptr;
c10::Allocator* base = nullptr;
// In a child of fork() (a DataLoader worker) an arena's lock may have been held by a thread
// the child does not have: there blocks bypass the arenas, freed straight to the OS.
bool forked = false;

void before_fork() { table_mu.lock(); }  // the table is whole in the child
void after_fork_parent() { table_mu.unlock(); }
void after_fork_child() {
  table_mu.unlock();
  forked = true;
  active = nullptr;
}

void unref(Arena* a, std::unique_lock<std::mutex>& lock) {
  bool last = --a->refs == 0;
  lock.unlock();
  if (last) delete a;
}

void drop_cache(Arena* a) {  // with a->mu held
  for (auto& b : a->cache) std::free(b.second);
  a->cache.clear();
  a->cached = 0;
}

void release(void* p) {
  Block b;
  {
    std::lock_guard<std::mutex> g(table_mu);
    auto it = table->find(p);
    if (it == table->end()) {  // not ours: raw memory the replaced allocator made
      c10::DeleterFnPtr d = base->raw_deleter();
      if (d != nullptr) d(p);
      return;
    }
    b = it->second;
    table->erase(it);
  }
  if (forked) {
    std::free(p);
    return;
  }
  Arena* a = b.arena;
  std::unique_lock<std::mutex> lock(a->mu);
  a->live -= b.size;
  if (!a->closed && a->cached + b.size <= a->limit) {
    a->cache.emplace_back(b.size, p);
    a->cached += b.size;
  } else {
    std::free(p);
  }
  unref(a, lock);
}

struct ArenaAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    Arena* a = active;
    if (a == nullptr || n < kMinBytes || forked) return base->allocate(n);
    size_t size = (n + kGranule - 1) / kGranule * kGranule;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(a->mu);
      // the block freed last that fits (the likeliest still in cache, as malloc's would
      // be), if it is less than twice the size
      for (auto it = a->cache.rbegin(); it != a->cache.rend(); ++it) {
        if (it->first < size || it->first >= 2 * size) continue;
        p = it->second;
        size = it->first;
        a->cache.erase(std::next(it).base());
        a->cached -= size;
        a->reused++;
        break;
      }
      a->refs++;
      a->live += size;
      a->peak = std::max(a->peak, a->live);
      a->call_bytes += size;
      a->limit = std::max(a->limit, a->call_bytes);
    }
    if (p == nullptr) {
      if (posix_memalign(&p, kAlign, size) != 0) {
        std::unique_lock<std::mutex> lock(a->mu);
        a->live -= size;
        unref(a, lock);
        return base->allocate(n);  // its out-of-memory error, as torch reports it
      }
      std::lock_guard<std::mutex> g(a->mu);
      a->fresh++;
    }
    {
      std::lock_guard<std::mutex> g(table_mu);
      (*table)[p] = Block{a, size};
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

ArenaAllocator* allocator = nullptr;

}  // namespace

extern "C" {

// Put the allocator in front of torch's CPU allocator; 1 when it is the one torch uses.
int opfuse_arena_install(void) {
  static std::mutex mu;  // (ctypes lets two threads in at once)
  std::lock_guard<std::mutex> g(mu);
  if (allocator == nullptr) {
    base = c10::GetCPUAllocator();
    allocator = new ArenaAllocator();
    c10::SetCPUAllocator(allocator, /*priority=*/1);
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
  }
  return c10::GetCPUAllocator() == allocator;
}

void* opfuse_arena_new(void) { return new Arena(); }

// Make `a` this thread's arena (nullptr: none); returns the one it replaces.
void* opfuse_arena_enter(void* a) {
  Arena* prev = active;
  if (forked) return prev;  // (its lock may be held by a thread this child lacks)
  active = static_cast<Arena*>(a);
  if (active != nullptr) {
    std::lock_guard<std::mutex> g(active->mu);
    active->call_bytes = 0;
  }
  return prev;
}

void opfuse_arena_exit(void* prev) { active = static_cast<Arena*>(prev); }

// The handle is gone: free the cache; blocks still out are freed when they come back.
void opfuse_arena_close(void* h) {
  if (forked) return;  // the parent's to free
  Arena* a = static_cast<Arena*>(h);
  std::unique_lock<std::mutex> lock(a->mu);
  a->closed = true;
  drop_cache(a);
  unref(a, lock);
}

// fresh blocks, reused blocks, bytes cached, the cache's limit, most bytes out at once
void opfuse_arena_stats(void* h, uint64_t* out) {
  for (int i = 0; i < 5; i++) out[i] = 0;
  if (forked) return;
  Arena* a = static_cast<Arena*>(h);
  std::lock_guard<std::mutex> g(a->mu);
  out[0] = a->fresh;
  out[1] = a->reused;
  out[2] = a->cached;
  out[3] = a->limit;
  out[4] = a->peak;
}
}
