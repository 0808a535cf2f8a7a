// Fibers for the kernel simulator (sim.cpp): one stackful fiber per CUDA thread of a
// block, all on the launching host thread, switched by a hand-written context switch
// (x86-64 SysV and AArch64 assembly; ucontext elsewhere, or with KVRS_SIM_UCONTEXT).
// A switch saves the callee-saved registers on the fiber's own stack and swaps stack
// pointers: no system call, unlike glibc's swapcontext (one sigprocmask per switch).
// Stacks are 64 KiB, mmap'd below a guard page, pooled and reused across launches.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <vector>

#if !defined(KVRS_SIM_UCONTEXT) && !(defined(__ELF__) && (defined(__x86_64__) || defined(__aarch64__)))
#define KVRS_SIM_UCONTEXT 1
#endif
#ifdef KVRS_SIM_UCONTEXT
#include <ucontext.h>
#endif

namespace kvrs_sim {

// A fiber's saved execution context.
#ifdef KVRS_SIM_UCONTEXT
struct Context {
    ucontext_t uc;
};
#else
struct Context {
    void* sp;  // the stack pointer, below the saved registers
};
#endif

}  // namespace kvrs_sim

#ifndef KVRS_SIM_UCONTEXT
// Saves the callee-saved registers on the current stack, stores the stack pointer in
// *save and continues the context whose stack pointer is `load`.
extern "C" void kvrs_sim_switch(void** save, void* load);
#if defined(__x86_64__)
// Frame (from the saved sp up): r15 r14 r13 r12 rbx rbp, return address.
asm(R"(
    .text
    .globl kvrs_sim_switch
    .hidden kvrs_sim_switch
    .type kvrs_sim_switch, @function
    .p2align 4
kvrs_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvrs_sim_switch, .-kvrs_sim_switch
)");
#elif defined(__aarch64__)
// Frame (176 bytes from the saved sp up): x19-x28, x29 (fp), x30 (lr), d8-d15.
asm(R"(
    .text
    .globl kvrs_sim_switch
    .hidden kvrs_sim_switch
    .type kvrs_sim_switch, %function
    .p2align 4
kvrs_sim_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size kvrs_sim_switch, .-kvrs_sim_switch
)");
#endif
#endif

namespace kvrs_sim {

// Bytes of one fiber stack (above its guard page).
constexpr size_t STACK_BYTES = 64 * 1024;

// Prepares `c` to run entry() on the stack [base, base + STACK_BYTES) when first
// switched to; entry must never return.
inline void context_init(Context* c, char* base, void (*entry)()) {
#ifdef KVRS_SIM_UCONTEXT
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = base;
    c->uc.uc_stack.ss_size = STACK_BYTES;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
#elif defined(__x86_64__)
    // The six registers, then entry as the return address, then a zero slot so that
    // entry starts as if called (rsp + 8 a multiple of 16).
    void** sp = reinterpret_cast<void**>(base + STACK_BYTES) - 8;
    for (int i = 0; i < 6; ++i) sp[i] = nullptr;
    sp[6] = reinterpret_cast<void*>(entry);
    sp[7] = nullptr;
    c->sp = sp;
#else
    // x19..x28 and x29 zero, x30 (the return address) = entry, d8..d15 zero.
    void** sp = reinterpret_cast<void**>(base + STACK_BYTES - 176);
    for (int i = 0; i < 22; ++i) sp[i] = nullptr;
    sp[11] = reinterpret_cast<void*>(entry);
    c->sp = sp;
#endif
}

// Saves the running context in `from` and continues `to`.
inline void context_switch(Context* from, Context* to) {
#ifdef KVRS_SIM_UCONTEXT
    swapcontext(&from->uc, &to->uc);
#else
    kvrs_sim_switch(&from->sp, to->sp);
#endif
}

// Fiber stacks of STACK_BYTES above a PROT_NONE guard page, kept for reuse. Returns
// nullptr when the system refuses the memory.
class StackPool {
  public:
    char* take() {
        {
            std::lock_guard<std::mutex> g(m_);
            if (!free_.empty()) {
                char* s = free_.back();
                free_.pop_back();
                return s;
            }
        }
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        void* p = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return nullptr;
        if (mprotect(p, page, PROT_NONE) != 0) {
            munmap(p, STACK_BYTES + page);
            return nullptr;
        }
        return static_cast<char*>(p) + page;
    }
    void give(const std::vector<char*>& stacks) {
        std::lock_guard<std::mutex> g(m_);
        free_.insert(free_.end(), stacks.begin(), stacks.end());
    }

  private:
    std::mutex m_;
    std::vector<char*> free_;
};

inline StackPool& stack_pool() {
    static StackPool pool;
    return pool;
}

}  // namespace kvrs_sim
