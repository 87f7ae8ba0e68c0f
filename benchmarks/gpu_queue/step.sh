# Sourced by the queues here: `step NAME LIMIT_S CMD...` runs CMD under a time limit, its output
# in $R/NAME.log, one line "NAME rc=N at S s" in $R/queue.log; a step that fails is logged and the
# queue goes on. STEPS="a b" in the environment runs only the steps named. `failed NAME` below.
t0=${t0:-$(date +%s)}
step() {
  local name=$1 limit=$2; shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0;; esac
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$R/queue.log"
}
# `failed NAME`: step NAME ran in this queue and failed (a check whose timed steps are skipped)
failed() { grep -q "^$1 rc=[1-9]" "$R/queue.log" 2>/dev/null; }
