"""`fleetrl demo`: the whole fleet on one machine, real processes, optionally under faults.

    runner     the `Demo`: starts the servers and daemons, watches them, stops them, audits
    books      `fleetrl audit` as a process, and the dead-letter tally (read on incrementally)
    procs      the work directory, the children's config, `Child` processes and their stopping
    view       progress from the children's JSON log events (live table, one line per step)
    fuzz_feed  the orders to the fuzzing producer (`fuzz`) and the wait for its records' dead letters
    ending     when a run bounded by its work (--duration, --fuzz-records, --until-faults) stops the trainer
    summary    summary.json and the table the demo ends with

The CLI imports `fleetrl.demo.runner:run_demo` only when `fleetrl demo` runs (help stays instant).
"""
